"""The protobuf exposition's messages (metrics.proto) and the module protoc generates from them (metrics_pb2)."""

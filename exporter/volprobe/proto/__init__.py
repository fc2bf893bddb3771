"""The protobuf exposition's messages (metrics.proto), which volprobe.protobuf encodes itself, and the module
protoc generates from them (metrics_pb2): the protobuf library's reference the tests compare the encoding with
(the library is a test dependency, not the exporter's)."""

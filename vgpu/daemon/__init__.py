"""The daemon's composition root: `vgpu serve`, the demo, `vgpu doctor` and the Prometheus metrics.

It wires the profiler's stream, the manager and the allocator together; nothing in the product imports it.

gRPC core writes its own log lines to stderr in plain text, beside the daemon's JSON records; it
reads GRPC_VERBOSITY once, when grpc is first imported, which for `vgpu serve` is after this package
is. Unless the operator set it, it is ERROR here: gRPC's informational chatter (a peer's GOAWAY, a
cancelled stream) stays out of the daemon's log, and its errors still show.
"""

import os

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

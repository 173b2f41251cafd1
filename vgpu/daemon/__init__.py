"""The daemon's composition root: `vgpu serve`, the demo, `vgpu doctor` and the Prometheus metrics.

It wires the profiler's stream, the manager and the allocator together; nothing in the product imports it.
"""

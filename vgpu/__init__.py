"""vgpu core: generated protocol stubs (`vgpu.v1`), the device layer, configuration, logging and the
canonical trace format shared by the profiler, the manager and the allocator."""

__version__ = "0.1.0"

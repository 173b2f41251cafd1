"""Generated protocol stubs of proto/vgpu/v1 (do not edit; run `make proto`)."""

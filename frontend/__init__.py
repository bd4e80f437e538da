"""HTTP frontends in front of the Triton server (clients of its gRPC frontend; the models stay as they are)."""

"""Engine-side helpers for mlx_nbdist (code that runs inside ipyparallel engines)."""

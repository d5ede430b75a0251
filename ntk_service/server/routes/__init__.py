"""One ``APIRouter`` per resource: health, architectures, models, datasets, kernels."""

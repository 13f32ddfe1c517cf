"""Model overlays: packages that register model types (with their MTP heads)
into mlx-lm before a rank loads, named by `[runtime] model_package`."""

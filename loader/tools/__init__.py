"""Programs built on the loader: the example trainer and the dist_sync launcher."""

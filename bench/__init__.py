"""fastzero's benchmark suite: ``python -m bench.run --kernel NAME``."""

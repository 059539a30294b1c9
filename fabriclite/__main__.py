"""``python -m fabriclite run ...``"""
from fabriclite.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

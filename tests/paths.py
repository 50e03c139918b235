"""Where the tests find the repository and the worker scripts, wherever a test module sits."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"

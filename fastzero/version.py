"""fastzero's version, in one place: the package (``fastzero.__version__``) and
setup.py (which runs this file by path) both read it."""

__version__ = "0.1.0"
# DeepSpeed's names for the parts (deepspeed.__version_major__ ...); ints, for comparisons.
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split(".")[:3])
version_info = (__version_major__, __version_minor__, __version_patch__)

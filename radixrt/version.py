"""radixrt's version: a leaf module, so any layer can read it (``radixrt.__version__``
is the same string)."""

__version__ = "0.1.0"

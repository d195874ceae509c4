"""The package's version, in the bottom layer so that every layer can name it (`tf-nvlink --version`, the
report, the tune cache's key).

Example:
    >>> from tf_nvlink.util.version import __version__
"""

__version__ = "0.1.0"

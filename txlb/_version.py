"""
txlb's version, the one place it is written (``setup.cfg`` reads it from here): shown as
``txlb.__version__``, in the start-up line and in the admin port's ``/status``.
"""

__version__ = "0.1.0"

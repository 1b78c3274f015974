"""One module per checkpoint format. Each defines ``NAME``, ``detect(path)``, ``read(path)`` and
``Writer``; ``dcptool.formats`` finds them by listing this package, so a new format is one new module."""

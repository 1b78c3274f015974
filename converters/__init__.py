"""One module per checkpoint format. Each defines ``NAME``, ``detect(files)``, ``read(files)`` and
``Writer``; ``dcptool.formats`` finds them by listing this package, so a new format is one new module.

Readers get a ``dcptool.storage.CheckpointFiles`` (local or remote, a folder or a single file) and
read, list and test files only through it."""

"""How bytes move: reading ranges of checkpoint files safely, and writing outputs atomically.

- ``files``: a checkpoint's files, local or at a URL fsspec opens (``is_remote``, ``CheckpointFiles``,
  ``LocalFolder``, ``FileWindow``); every name a checkpoint gives is kept inside its folder.
- ``outputs``: writing outputs (``OutputFiles``) and putting them in place atomically
  (``check_destination``, ``check_apart``, ``output_path``, ``atomic_output``, ``output_state``, the temporaries of
  dead writers, ``fsync_tree`` / ``fsync_paths``).
- ``renames``: renames in one step (``renameat2``, ``renamex_np``) and their fallbacks.
- ``naming``: messages name files as the user knows them (``showing``, ``shown_path``, ``annotate``).
- ``interrupts``: Ctrl-C handling (``Interrupted``, ``handle_interrupts``, ``deferred_interrupts``).

The names other modules use are imported from here.
"""

from dcptool.storage.files import CheckpointFiles, is_remote
from dcptool.storage.interrupts import (Interrupted, deferred_interrupts, handle_interrupts, interrupts_handled,
                                        raise_interrupted)
from dcptool.storage.naming import showing
from dcptool.storage.outputs import (OutputFiles, atomic_output, check_apart, check_destination, fsync_paths, fsync_tree,
                                     output_path, output_state, stale_temporaries)

__all__ = ["CheckpointFiles", "is_remote", "Interrupted", "deferred_interrupts", "handle_interrupts",
           "interrupts_handled", "raise_interrupted", "showing", "OutputFiles", "atomic_output", "check_apart",
           "check_destination", "fsync_paths", "fsync_tree", "output_path", "output_state", "stale_temporaries"]

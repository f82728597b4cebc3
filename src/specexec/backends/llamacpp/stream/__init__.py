"""Running a GGUF target in less RAM than its weights: what does not fit is read from disk on every pass.

llama.cpp maps the GGUF read-only and its CPU kernels read the weights straight from the mapping (with
repacking off: `use_extra_bufts = False`, else some tensor types are copied into anonymous memory, which
cannot be streamed). Left to the page cache, its LRU evicts each page just before the next pass needs
it. `Streamer` decides instead, in units of one layer (`blk.N`) plus the output head:

- **resident** units stay in the page cache (populated at load, never dropped): the head, then layers
  spread evenly over the pass (`plan`);
- **streamed** units are read ahead of compute by a thread of ours (`reader`), as many as fit in the
  read-ahead window (the bytes of the largest `AHEAD` + 1 units in a row) with the one computing, and let
  go of as soon as llama.cpp's eval callback (`callback`) reports the layer's output; after a pass the
  reader reads the next pass's first units into the whole window while the draft works (with a large
  output head, many layers). Where the file system takes O_DIRECT, a unit is read past the page cache
  into memory of our own (`os_calls.Ring`), mapped over the unit's pages in llama.cpp's mapping once read
  whole (compute waits for it at the layer before), and the file is mapped back there when compute is
  done. Elsewhere it goes through the page cache;
- the token embedding table is gathered a few rows a pass: it is never read ahead, and the rows a pass
  touched are dropped after it.

A split GGUF (NAME-00001-of-0000N.gguf and its siblings, which llama.cpp maps one by one) is streamed as
one model: offsets here are `specexec.backends.gguf_files`'s global ones, which name the file too.

Neither way can change a result: a unit's addresses hold the file's bytes at all times, mapped from the
file (read again if touched again) or from a copy read whole. The file is checked before every pass: one
that changed on disk is an error (`LlamaCppError`), since the kernels would be handed other weights.

Modules: `planning` (pure: units, what stays resident, the window), `os_calls` (the system calls),
`reader` (the thread and its two ways to read), `callback` (llama.cpp's eval callback), `streamer`
(`Streamer`).
Only `specexec.backends.llamacpp` imports this package (`weights.load_weights` loads a streamed model).
"""

from specexec.backends.llamacpp.stream.callback import LayerEvents
from specexec.backends.llamacpp.stream.os_calls import evict, mapped, mapping_bases
from specexec.backends.llamacpp.stream.planning import AHEAD, Plan, Unit, layout, least_ram, plan, spread
from specexec.backends.llamacpp.stream.streamer import Streamer, restore_resident

__all__ = [
    "AHEAD",
    "LayerEvents",
    "Plan",
    "Streamer",
    "Unit",
    "evict",
    "layout",
    "least_ram",
    "mapped",
    "mapping_bases",
    "plan",
    "restore_resident",
    "spread",
]

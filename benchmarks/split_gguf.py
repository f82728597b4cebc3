"""Write a GGUF as a split GGUF (`llama-gguf-split`'s layout: NAME-00001-of-0000N.gguf and its siblings),
files of at most --max-size bytes, to check that `--ram` streams a split model as it does the single
file (docs/benchmarks-history.md, 2026-12-06, "Split GGUFs").

    python benchmarks/split_gguf.py SOURCE.gguf DEST/NAME.gguf --max-size 400MiB
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter

from specexec.sizes import parse_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path, help="NAME.gguf: the files are NAME-0000k-of-0000N.gguf")
    parser.add_argument("--max-size", default="400MiB", help="the most bytes of tensors a file holds")
    args = parser.parse_args()
    reader = GGUFReader(args.source)
    writer = GGUFWriter(
        args.dest, reader.fields["general.architecture"].contents(), split_max_size=parse_size(args.max_size)
    )
    for name, field in reader.fields.items():
        # The writer adds the header's own fields, the architecture and the split keys itself.
        if name.startswith(("GGUF.", "split.")) or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(
            name, field.contents(), kind, sub_type=field.types[-1] if kind == GGUFValueType.ARRAY else None
        )
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)  # shape from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for path in sorted(args.dest.parent.glob(f"{args.dest.stem}-*-of-*.gguf")):
        print(path)


if __name__ == "__main__":
    main()

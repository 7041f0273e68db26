#!/usr/bin/env python3
"""Keep the first N transformer blocks of a GGUF model (tensors copied byte for byte, metadata
unchanged but `<arch>.block_count`), so a real model's kernels and per-layer shapes fit under the
device tool's 64 MiB carry limit for CPU timings on the quiet GPU host. Not a usable model: its
answers are meaningless; only A/B timings of the same file are.

    python scripts/truncate_gguf.py IN.gguf OUT.gguf N
"""
import re
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def main() -> None:
    src, dst, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == f"{arch}.block_count":
            writer.add_uint32(field.name, keep)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        block = re.match(r"blk\.(\d+)\.", t.name)
        if block and int(block.group(1)) >= keep:
            continue
        shape = [int(x) for x in reversed(t.shape)]
        if t.tensor_type in (Q.F32, Q.F16):
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape))
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{dst}: {keep} blocks")


if __name__ == "__main__":
    main()

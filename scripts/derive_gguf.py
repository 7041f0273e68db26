#!/usr/bin/env python3
"""Derive an F16 or Q8_0 variant of a GGUF model with the `gguf` package: every quantized
tensor is dequantized and stored in the target type; F32 tensors (norms) stay F32; metadata is
copied unchanged except `general.file_type`.

    python scripts/derive_gguf.py IN.gguf OUT.gguf f16|q8_0
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

TARGETS = {"f16": (Q.F16, LlamaFileType.MOSTLY_F16), "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0)}


def copy_metadata(reader: GGUFReader, writer: GGUFWriter, file_type: int) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name == "general.file_type":
            writer.add_uint32(field.name, int(file_type))
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)


def main() -> None:
    src, dst, target = sys.argv[1], sys.argv[2], sys.argv[3]
    qtype, file_type = TARGETS[target]
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    copy_metadata(reader, writer, file_type)
    for t in reader.tensors:
        shape = [int(x) for x in reversed(t.shape)]  # numpy order
        if t.tensor_type == Q.F32:
            writer.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
            continue
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if qtype == Q.F16:
            writer.add_tensor(t.name, values.astype(np.float16))
        else:
            q = quantize(values, qtype)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"{dst}: {target}")


if __name__ == "__main__":
    main()

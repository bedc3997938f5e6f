"""Write a copy of a GGUF file with every tensor dequantized to F32, metadata unchanged.

For numerics checks against llama.cpp: on the dequantized copy both engines compute the same
function exactly in float32 (llama.cpp rounds a matmul's input to 8 bits per block only
where the weight is quantized), so a difference left there is a difference of the model's
implementation, not of quantized arithmetic. Weights are dequantized with the ``gguf``
package. Usage:
``python -m benchmarks.engine.dequantize_gguf --model gemma3-270m --out /tmp/gemma-f32.gguf``.
"""

from __future__ import annotations

import argparse

import gguf
import numpy as np

from radixserve.model.loader import resolve_model_path

# the fields GGUFWriter writes itself
OWN_FIELDS = ("GGUF.", "general.architecture")


def dequantize_file(src: str, out: str) -> None:
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith(OWN_FIELDS):
            continue
        if name == "general.file_type":
            writer.add_uint32(name, int(gguf.LlamaFileType.ALL_F32))
        elif field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), field.types[0])
    for tensor in reader.tensors:
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, array.reshape([int(x) for x in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf file or a known model's name")
    parser.add_argument("--out", required=True, help="the F32 .gguf file to write")
    args = parser.parse_args()
    path = resolve_model_path(args.model)
    if path.suffix != ".gguf":
        parser.error(f"--model must be a .gguf file, got {path}")
    dequantize_file(str(path), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

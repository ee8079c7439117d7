"""`python -m qatfactory.formats` prints the table of formats in docs/formats.md from the registry."""
from . import REGISTRY
from .layouts import Codec


def containers(spec) -> str:
    """What each engine container holds for the format (its spec's layout records)."""
    out = []
    g = spec.gguf
    if g is not None:
        how = "" if g.codec is Codec.GGML_BLOCKS else \
            " (repacked" + (", + F32 `.scale`" if g.codec is Codec.E2M1_E4M3_FP32 else "") + ")"
        out.append(f"GGUF {g.ggml_type.name}{how}")
    st = spec.safetensors
    if st is not None:
        grp = "channel" if st.group_size is None else f"{st.strategy} {st.group_size}"
        mo = f"; ModelOpt {' / '.join(st.modelopt_algo)}" if st.modelopt_algo else ""
        out.append(f"compressed-tensors `{st.ct_format}` ({grp}){mo}")
    return "; ".join(out) if out else "none (activation rule only)" if spec.role == "activation" else "none"


def markdown_table() -> str:
    rows = ["| name | engine (numerics followed) | block | scale (codec: rule) | element ties | bits/weight | "
            "engine containers | oracle |",
            "|---|---|---|---|---|---|---|---|"]
    for name in sorted(REGISTRY):
        s = REGISTRY[name].spec
        block = f"{s.block_size}" if s.super_block == s.block_size else f"{s.block_size or 'row'} in {s.super_block}"
        gs = f" + fp32 per tensor ({s.global_scale})" if s.global_scale else ""
        rows.append(f"| `{s.name}` | {s.engine} | {block} | {s.scale_codec}: {s.scale_rule}{gs} | {s.tie_rule} "
                    f"| {s.bits_per_weight:g} | {containers(s)} | {s.oracle} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

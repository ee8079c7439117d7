"""`python -m qatfactory.formats` prints the README's table of formats from the registry."""
from . import REGISTRY


def markdown_table() -> str:
    rows = ["| name | engine (numerics followed) | block | scale (codec: rule) | element ties | bits/weight | oracle |",
            "|---|---|---|---|---|---|---|"]
    for name in sorted(REGISTRY):
        s = REGISTRY[name].spec
        block = f"{s.block_size}" if s.super_block == s.block_size else f"{s.block_size or 'row'} in {s.super_block}"
        gs = f" + fp32 per tensor ({s.global_scale})" if s.global_scale else ""
        rows.append(f"| `{s.name}` | {s.engine} | {block} | {s.scale_codec}: {s.scale_rule}{gs} | {s.tie_rule} "
                    f"| {s.bits_per_weight:g} | {s.oracle} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())

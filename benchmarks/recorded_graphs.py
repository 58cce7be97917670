"""The decode graphs Dynamo hands ``backend="replayssm"`` for a model's ``generate``, for diagnostics: greedy decode
eagerly, then compiled through a recording backend in front of ours; returns the graphs and whether the tokens
matched (printing the failure, if the compiled run fails, so that the graphs recorded so far can still be shown)."""

import torch


def record_decode_graphs(model, ids: torch.Tensor, new: int = 24) -> list:
    from replay_compile.backend import replayssm_backend

    graphs = []

    def recording(gm, example_inputs, **kw):
        graphs.append(gm)
        return replayssm_backend(gm, example_inputs, **kw)

    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=new, do_sample=False)
        model.forward = torch.compile(model.forward, backend=recording)
        try:
            out = model.generate(ids, max_new_tokens=new, do_sample=False)
            print("tokens identical:", bool((out == ref).all()))
        except Exception as e:  # noqa: BLE001 - still show the graphs
            print("compiled generate failed:", type(e).__name__, str(e)[:800])
    return graphs


def print_launches(graphs: list, before: int = 12, after: int = 10) -> None:
    """Each graph's Triton launches (one per kernel): the kernel's name, its constant arguments, the launch node
    and the nodes around it."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    for i, gm in enumerate(graphs):
        nodes = list(gm.graph.nodes)
        hops = [n for n in nodes if "triton_kernel_wrapper" in str(n.target)]
        print(f"--- graph {i}: {len(nodes)} nodes, {len(hops)} triton kernel launches")
        seen = set()
        for n in hops:
            k = kernel_side_table.get_kernel(n.kwargs["kernel_idx"])
            name = getattr(getattr(k, "fn", k), "__name__", str(k))
            if name in seen:
                continue
            seen.add(name)
            print("   kernel:", name, "| constants:",
                  kernel_side_table.get_constant_args(n.kwargs["constant_args_idx"]))
            print("  ", n.format_node()[:1500])
            j = nodes.index(n)
            for m in nodes[max(0, j - before): j + after]:
                print("     ", m.format_node()[:300])

"""What Inductor copies around our inlined step kernels, found without a GPU.

    python benchmarks/diag_inline_cpu.py --family nemotron_h --variant pre [--batch 2]

Traces a tiny model of ``--family`` (replay_compile.testing.hf_models) through ``backend="replayssm"`` with the step
ops inlined (ops/library.py, ``REPLAY_COMPILE_INLINE_KERNELS=all``) on CPU tensors, then runs AOTAutograd as Inductor
does (input mutations kept in the graph) and Inductor's re-inplacing pass on the functional graph, and prints per
traced kernel launch the arguments still to be cloned (a copy per step) with their later users. Nothing runs:
Triton only lowers each kernel to TTIR for torch's mutation analysis, against a stand-in CUDA target (sm_90).

A diagnostic for machines without a GPU (it found the cursor passed as a stand-in
slot pointer copied on every step). It patches private torch / Triton internals; versions other than the ones it
was written against (torch 2.13, triton 3.6-3.9) may need adjustments.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch


def _kernel_name(node) -> str:
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    return kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__


def _inspect(gm, example_inputs):
    """AOTAutograd's forward compiler here: re-inplace as Inductor does, then report what is still cloned."""
    from torch._guards import detect_fake_mode
    from torch._inductor.fx_passes.reinplace import reinplace_inplaceable_ops
    from torch._inductor.fx_utils import FakeTensorUpdater
    from torch._inductor.virtualized import V

    graph = gm.graph
    with V.set_fake_mode(detect_fake_mode(example_inputs)):
        reinplace_inplaceable_ops(FakeTensorUpdater(gm), graph)
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in graph.nodes:
        if "triton_kernel_wrapper" not in str(node.target):
            continue
        clones = list(node.kwargs.get("tensors_to_clone", []))
        print(f"{_kernel_name(node):36s} cloned per step: {clones or 'nothing'}")
        # read-only inputs made contiguous for the launch (ops/library.compact_inputs): a copy kernel each, unless
        # Inductor fuses it into the producer
        copied = [f"{k} <- {v.args[0].name if v.args else '?'}" for k, v in node.kwargs["kwargs"].items()
                  if isinstance(v, torch.fx.Node) and "clone" in str(v.target)]
        print(f"{'':36s} inputs copied contiguous: {copied or 'none'}")
        for name in clones:
            arg = node.kwargs["kwargs"][name]
            later = [u.format_node()[:140] for u in arg.users if order[u] > order[node]]
            print(f"    {name} = {arg.name} ({arg.op}); later users: {later or 'none'}")
    return gm.forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="nemotron_h")
    ap.add_argument("--variant", default="pre", help="kernel variant forced through the family's TUNING")
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ["REPLAY_COMPILE_INLINE_KERNELS"] = "all"
    os.environ["REPLAY_COMPILE_VALIDATE"] = "0"            # the kernels cannot run here

    from triton.runtime import driver

    from replay_compile.testing.standin_driver import StandInDriver
    driver.set_active(StandInDriver())

    import torch._inductor.compile_fx as compile_fx
    from torch._functorch.aot_autograd import aot_module_simplified

    import replay_compile.ops.library as library
    from replay_compile.kernels import delta_triton, mamba2_triton
    from replay_compile.testing import hf_models

    library._all_cuda = lambda a, k: True                 # inline CPU tensors too (never launched)
    compile_fx.compile_fx = lambda gm, inputs, config_patches=None: aot_module_simplified(
        gm, inputs, fw_compiler=_inspect, keep_inference_input_mutations=True)
    delta = args.family in hf_models.DELTA_FAMILY
    (delta_triton if delta else mamba2_triton).TUNING["variant"] = args.variant

    from transformers import StaticCache

    from replay_compile.bench import cache_kwarg

    model = (hf_models.DELTA_FAMILY if delta else hf_models.MAMBA2_FAMILY)[args.family]()
    ids = torch.randint(3, 100, (args.batch, 5))
    cache = StaticCache(config=model.config, max_cache_len=16)
    ck = cache_kwarg(model)
    step = torch.compile(model.forward, backend="replayssm", options={"buffer_len": 4})
    with torch.no_grad():
        model(ids, use_cache=True, cache_position=torch.arange(5), **{ck: cache})
        try:
            step(ids[:, -1:], use_cache=True, cache_position=torch.tensor([5]), **{ck: cache})
        except Exception as e:  # noqa: BLE001 - the compiled step cannot run without a GPU; the report is out
            print(f"(the step itself does not run here: {type(e).__name__})", file=sys.stderr)


if __name__ == "__main__":
    main()

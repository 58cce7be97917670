"""Speculative decoding with the replay state: verify drafts without writing the SSM state, roll back by
moving cursors.

    from replay_compile.speculative import generate_speculative, PromptLookup
    out = generate_speculative(model, input_ids, max_new_tokens=128, num_draft=3, draft=PromptLookup(ngram=3))

Greedy output is identical to ``model.generate(..., do_sample=False)``. Supported today: the Mamba-2 mixers of the
HF hybrid families (NemotronH, Mamba2, Bamba, Zamba2, GraniteMoeHybrid), Gated DeltaNet (Qwen3.5, Qwen3.5-MoE,
Qwen3-Next) and Kimi Delta Attention (Kimi-Linear); other SSM layers (Falcon-H1's mixer, Mamba-1, ...) raise a clear
error naming the layer.
"""

from .draft_model import DraftModel
from .drafts import PromptLookup
from .generate import SpeculativeOutput, generate_speculative
from .generator import SpeculativeGenerator

__all__ = ["DraftModel", "PromptLookup", "SpeculativeGenerator", "SpeculativeOutput", "generate_speculative"]

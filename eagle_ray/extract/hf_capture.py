"""Reference capture backend: HF transformers `output_hidden_states` (small targets).

Same interface as `VllmCapture`: `capture(sequences) -> [(aux [T, A*H], final [T, H])]`.
The model is the target's text causal LM (`eagle_ray.targets.load_causal_lm`: for a
multimodal wrapper such as Kimi-K2.5, its language model alone).
Batches are right-padded: with a causal mask, padding after a sequence cannot change the
states of its real tokens, and rows are cut back to each sequence's length.

    hidden_states[0]    = embeddings            = input to layer 0
    hidden_states[i]    = input to layer i      -> aux feature for layer i
    hidden_states[L]    = norm(output of layer L-1) -> final feature (lm_head(final) = logits)
"""

from __future__ import annotations

from typing import Sequence


class HFCapture:
    def __init__(self, model_path: str, aux_layer_ids: Sequence[int], *, device: str = "cpu",
                 dtype: str = "float32", revision: str | None = None,
                 trust_remote_code: bool = False):
        from eagle_ray.targets.load import load_causal_lm

        self.device = device
        self.aux_layer_ids = tuple(aux_layer_ids)
        # The text causal LM; a multimodal wrapper (Kimi-K2.5) loads its language_model.*.
        self.model = load_causal_lm(model_path, dtype=dtype, revision=revision,
                                    trust_remote_code=trust_remote_code).to(device).eval()
        L = self.model.config.num_hidden_layers
        if any(not 0 <= i < L for i in self.aux_layer_ids):
            raise ValueError(f"aux layer ids {self.aux_layer_ids} outside [0, {L - 1}]")
        self.pad_id = self.model.config.pad_token_id or 0

    def capture(self, sequences: list[list[int]]) -> list[tuple]:
        import torch

        if not sequences:
            return []
        lengths = [len(s) for s in sequences]
        T = max(lengths)
        ids_BT = torch.full((len(sequences), T), self.pad_id, dtype=torch.long)
        mask_BT = torch.zeros((len(sequences), T), dtype=torch.long)
        for b, s in enumerate(sequences):
            ids_BT[b, :len(s)] = torch.as_tensor(s, dtype=torch.long)
            mask_BT[b, :len(s)] = 1
        with torch.no_grad():
            out = self.model.model(input_ids=ids_BT.to(self.device),
                                   attention_mask=mask_BT.to(self.device),
                                   output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        aux_BTD = torch.cat([hs[i] for i in self.aux_layer_ids], dim=-1).float().cpu()
        final_BTH = hs[-1].float().cpu()
        return [(aux_BTD[b, :n].contiguous(), final_BTH[b, :n].contiguous())
                for b, n in enumerate(lengths)]

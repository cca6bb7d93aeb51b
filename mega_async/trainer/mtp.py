"""Multi-token-prediction (MTP) layers in training: Megatron-Core's MTP block, its loss computed here.

DeepSeek-V3's MTP layer k at position i combines the hidden state h_i (after the final norm) with the embedding of
token i+k+1: eh_proj(cat(enorm(emb(t_{i+k+1})), hnorm(h_i))) (embedding first, as the checkpoints' eh_proj and
SGLang's NextN draft have it), runs one decoder block, then the shared head's norm and the output layer, and
predicts token i+k+2. Megatron-Core 0.16 builds that block (`MultiTokenPredictionBlock`); its GPTModel computes the
MTP loss only together with a language-model loss from labels, which the RL objective does not use (it needs the
logits). `MTPGPTModel` therefore runs the block in training only and returns the main logits with the MTP layers'
logits; the engine adds `trainer.mtp_loss_scaling_factor` x their cross-entropy (a token sum over the trained
tokens, like the policy loss) and logs it apart (`mtp_loss`). In evaluation (logprobs) the block is skipped.
`trainer.mtp: freeze` never runs it and takes its parameters out of the optimizer: they are carried unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

MODES = ("train", "freeze")


@dataclass
class MTPOutput:
    """What an MTP model returns in training: the main logits [b, s, v] and each MTP layer's [b, s, v]."""
    logits: torch.Tensor
    mtp_logits: list[torch.Tensor]

    @property
    def device(self) -> torch.device:  # Megatron's schedule reads the output's device (MoE aux-loss scale)
        return self.logits.device


def split_output(out: Any) -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The model's output -> (main logits [b, s, v], MTP layers' logits or None)."""
    if isinstance(out, MTPOutput):
        return out.logits, out.mtp_logits
    return out, None


def mtp_block_spec(bridge: Any, decoder_spec: Any, vp_stage: Optional[int]) -> Any:
    """Megatron's MTP block spec for this stage (None where the stage holds no MTP layer): the decoder's last layer
    spec (an MoE layer for DeepSeek-V3 and GLM-4.5, with this project's attention), with RMSNorms on the local spec."""
    if not getattr(bridge.config, "mtp_num_layers", None):
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    spec = get_gpt_mtp_block_spec(bridge.config, decoder_spec, use_transformer_engine=bridge.use_te, vp_stage=vp_stage)
    if spec is not None and not bridge.use_te:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        for layer in spec.layer_specs:  # the local provider's default norm may be LayerNorm (config says RMSNorm)
            sub = layer.submodules
            sub.enorm = sub.hnorm = sub.layer_norm = WrappedTorchNorm
    return spec


def _model_class() -> type:
    from megatron.core.models.gpt import GPTModel

    class MTPGPTModel(GPTModel):
        """GPTModel with MTP layers. With labels, Megatron's own path (its MTP loss rides on the main loss's
        backward). Without labels it returns the logits; in training, when the trainer engine asked for them
        (`mtp_logits`), with the MTP layers' logits as `MTPOutput`. Frozen (`mtp_trains` False), the block never
        runs."""

        mtp_trains = True  # False: trainer.mtp=freeze (the block never runs; its parameters take no gradient)
        mtp_logits = False  # True: the engine computes the MTP loss from the MTP layers' logits (MTPOutput)

        def _postprocess(self, hidden_states: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         labels: Any, rotary_pos_emb: Any, rotary_pos_cos: Any, rotary_pos_sin: Any,
                         mtp_in_postprocess: Any = None, loss_mask: Any = None, decoder_input: Any = None,
                         attention_mask: Any = None, inference_params: Any = None, packed_seq_params: Any = None,
                         sequence_len_offset: Any = None, runtime_gather_output: Any = None,
                         extra_block_kwargs: Any = None, inference_context: Any = None, **kw: Any) -> Any:
            args = dict(mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask, decoder_input=decoder_input,
                        attention_mask=attention_mask, inference_params=inference_params,
                        packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                        runtime_gather_output=runtime_gather_output, extra_block_kwargs=extra_block_kwargs,
                        inference_context=inference_context, **kw)
            if (labels is not None or inference_context is not None) and self.mtp_trains:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                                            rotary_pos_cos, rotary_pos_sin, **args)
            run = bool(mtp_in_postprocess) and self.training and self.mtp_trains and self.mtp_logits
            if run:
                hidden_states = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                                         attention_mask=attention_mask, inference_params=inference_params,
                                         rotary_pos_emb=rotary_pos_emb, rotary_pos_cos=rotary_pos_cos,
                                         rotary_pos_sin=rotary_pos_sin, packed_seq_params=packed_seq_params,
                                         sequence_len_offset=sequence_len_offset, embedding=self.embedding,
                                         **(extra_block_kwargs or {}))
            if not self.post_process:
                return hidden_states
            weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None

            def head(h: torch.Tensor) -> torch.Tensor:
                logits, _ = self.output_layer(h, weight=weight, runtime_gather_output=runtime_gather_output)
                return logits

            if run:
                parts = torch.chunk(hidden_states, 1 + self.config.mtp_num_layers, dim=0)
                return MTPOutput(head(parts[0]).transpose(0, 1).contiguous(),
                                 [head(h).transpose(0, 1).contiguous() for h in parts[1:]])
            logits = head(hidden_states)
            if labels is not None:  # frozen MTP layers: the language-model loss alone
                return self.compute_language_model_loss(labels, logits)
            return logits.transpose(0, 1).contiguous()  # [s, b, v] -> [b, s, v]

    return MTPGPTModel


MODEL_CLASS: Optional[type] = None


def model_class() -> type:
    """The GPTModel subclass built for configs with MTP layers (created once, on first use: Megatron imports late)."""
    global MODEL_CLASS
    if MODEL_CLASS is None:
        MODEL_CLASS = _model_class()
    return MODEL_CLASS


def mtp_targets(labels: torch.Tensor, loss_mask: torch.Tensor, cu_seqlens: torch.Tensor,
                depth: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """MTP layer `depth`'s targets on a packed stream: at position t the token `depth` after the next one (labels
    shifted left by `depth` inside each sequence) and whether it is trained (the loss mask shifted alike); the last
    `depth` positions of every sequence (and the stream's tail after the last) have none."""
    out_l, out_m = torch.zeros_like(labels), torch.zeros_like(loss_mask)
    cu = [int(x) for x in cu_seqlens]
    for s, e in zip(cu[:-1], cu[1:]):
        if e - s > depth:
            out_l[s:e - depth] = labels[s + depth:e]
            out_m[s:e - depth] = loss_mask[s + depth:e]
    return out_l, out_m


def mtp_loss_sum(mtp_logits: list[torch.Tensor], labels: torch.Tensor, loss_mask: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy (temperature 1) of every MTP layer's prediction, summed over the trained positions and averaged
    over the layers (Megatron's mtp_loss_scaling_factor / mtp_num_layers); returns (sum, trained positions of the
    first layer). logits [T, v/tp] per layer (vocab-parallel)."""
    from mega_async.trainer.logprobs import vocab_parallel_logprobs

    dev = mtp_logits[0].device
    total, count = torch.zeros((), device=dev), torch.zeros((), device=dev)
    for depth, logits in enumerate(mtp_logits, start=1):
        lab, mask = mtp_targets(labels, loss_mask, cu_seqlens, depth)
        logp = vocab_parallel_logprobs(logits, lab.to(dev), 1.0)[0]
        mask = mask.to(dev).to(logp.dtype)
        total = total - (logp * mask).sum()
        if depth == 1:
            count = mask.sum()
    return total / len(mtp_logits), count


def freeze(models: list[torch.nn.Module]) -> int:
    """trainer.mtp=freeze: the MTP block never runs and its parameters take no gradient (out of the optimizer, so
    they are exported as loaded). Returns the parameters frozen."""
    n = 0
    for m in models:
        while hasattr(m, "module"):
            m = m.module
        if getattr(m, "mtp_process", False):
            m.mtp_trains = False
            for p in m.mtp.parameters():
                p.requires_grad_(False)
                n += 1
    return n

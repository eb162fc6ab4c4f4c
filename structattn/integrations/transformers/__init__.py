"""structattn inside Hugging Face ``transformers`` (``pip install 'structattn[transformers]'``).

- ``StructAttnConfig``, ``StructAttnModel``, ``StructAttnForCausalLM``: a Llama-shaped decoder
  whose attention is a structattn declaration named in the config, registered with
  ``AutoConfig`` / ``AutoModel`` / ``AutoModelForCausalLM`` (``model_type="structattn"``);
- ``StructAttnCache``: HF's ``Cache`` over structattn's decoding caches (growing, fixed
  capacity, certified eviction), for ``generate()``;
- ``convert``: a stock Llama-family model turned into one (q/k/v/o copied, RoPE kept);
- ``register_attention``, ``use_prior``, ``StructAttnPrior``: any model that calls
  ``AttentionInterface`` (Llama, Mistral, Qwen …) reading its own q, k, v under a stationary
  structattn prior (ALiBi, relative positions, the generalised Gaussian, a ``DistancePrior``),
  prefill and decoding alike (``aligned_attention``, the function they call).

See docs/guide/transformers.md.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as err:  # pragma: no cover - exercised without the extra
    raise ImportError("structattn.integrations.transformers needs Hugging Face transformers: "
                      "pip install 'structattn[transformers]'") from err

from .versions import check_version

check_version(transformers.__version__)

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM  # noqa: E402

from .aligned import aligned_attention  # noqa: E402
from .cache import StructAttnCache  # noqa: E402
from .configuration import StructAttnConfig  # noqa: E402
from .convert import convert  # noqa: E402
from .interface import StructAttnPrior, register_attention, use_prior  # noqa: E402
from .modeling import StructAttnForCausalLM, StructAttnModel  # noqa: E402

AutoConfig.register(StructAttnConfig.model_type, StructAttnConfig, exist_ok=True)
AutoModel.register(StructAttnConfig, StructAttnModel, exist_ok=True)
AutoModelForCausalLM.register(StructAttnConfig, StructAttnForCausalLM, exist_ok=True)

__all__ = ["StructAttnCache", "StructAttnConfig", "StructAttnForCausalLM", "StructAttnModel",
           "StructAttnPrior", "aligned_attention", "convert", "register_attention", "use_prior"]

"""What export needs of a PEFT model (a LoRA fine-tune): recorded at save time, its adapters'
configurations and its base model's class; at export, the same PEFT model rebuilt without
weights, to load the checkpoint's weights into.

Recorded as JSON in the checkpoint's model information (``"peft"``: adapter name -> its
``PeftConfig.to_dict()``; ``"base_class"``, ``"base_module"``; ``"active_adapter"``). The PEFT
configuration class is chosen by the recorded ``peft_type`` from PEFT's own table; nothing
named by a checkpoint is imported.
"""

from __future__ import annotations

import json
from typing import Any

import transformers

from ..errors import ConfigError


def peft_info(model: Any) -> dict[str, Any]:
    """The PEFT part of the model information (empty for a model that is not a PeftModel)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not callable(getattr(model, "get_base_model", None)):
        return {}
    base = type(model.get_base_model())
    return {
        "peft": {name: json.dumps(c.to_dict(), default=_jsonable) for name, c in configs.items()},
        "base_class": base.__name__,
        "base_module": base.__module__,
        "active_adapter": str(getattr(model, "active_adapter", "default")),
    }


def _jsonable(o: Any) -> Any:
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    return str(o)


def peft_base_class(info: dict[str, Any]) -> type:
    """The recorded base model's class, looked up by name in ``transformers``."""
    cls = getattr(transformers, str(info["base_class"]), None)
    if not isinstance(cls, type):
        raise ConfigError(
            f"the checkpoint's base model class {info['base_module']}.{info['base_class']} is "
            "not part of transformers; pass model_class=<the base model's class> to export it"
        )
    return cls


def empty_peft_model(info: dict[str, Any], config: Any, base_class: type) -> Any:
    """The recorded PEFT model, rebuilt on the meta device (weights are assigned afterwards)."""
    try:
        import peft
    except ImportError as e:
        raise ConfigError(
            f"the checkpoint holds a PEFT model ({info['class']}); exporting it needs peft ({e})"
        ) from None
    from accelerate import init_empty_weights

    configs = {
        name: peft.PeftConfig.from_peft_type(**json.loads(c)) for name, c in info["peft"].items()
    }
    active = str(info.get("active_adapter") or next(iter(configs)))
    with init_empty_weights():
        model = peft.get_peft_model(base_class(config), configs[active], adapter_name=active)
        for name, c in configs.items():
            if name != active:
                model.add_adapter(name, c)
    model.set_adapter(active)
    return model

"""--model-name to a transformers config: a named size (published hyperparameters, no download) or a local directory."""
from pathlib import Path

from utils.errors import UsageError


def resolve_model_config(model_name: str, sizes: dict, config_class, model_type: str, script: str):
    """A fresh config for a size name, or the config.json of a directory (which must be of `model_type`).

    Size names win over directories, so `--model-name gpt2` run from the repository root (which has a gpt2/
    folder) still means the published GPT-2 size.
    """
    if model_name in sizes:
        return config_class(**sizes[model_name])
    directory = Path(model_name)
    if directory.is_dir():
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise UsageError(f"{directory}: no config.json (--model-name takes {', '.join(sizes)} or a model directory)")
        from transformers import AutoConfig  # reads model_type from the file; config_class would coerce it
        try:
            config = AutoConfig.from_pretrained(str(directory))
        except (OSError, ValueError) as exc:
            raise UsageError(f"{config_file}: cannot read it as a {model_type} config ({str(exc).splitlines()[0]})") from None
        if getattr(config, "model_type", None) != model_type:
            raise UsageError(f"{config_file}: model_type is {config.model_type!r}, but {script} trains {model_type!r} models")
        return config
    raise UsageError(f"--model-name {model_name!r}: not one of {', '.join(sizes)}, and not a directory with a config.json")

"""Sampler override presets, as TabbyAPI's ``sampler_overrides`` folder: YAML files of

    temperature:
      override: 0.8     # the value
      force: false      # true: replaces what the request sent; false: the default when it sent nothing
    stop:
      override: ["###"]
      additive: true    # lists only: put before the request's own list

Keys are the generation requests' sampler fields under any of their names (``rep_pen`` ...); each value is checked
as that field when the preset is loaded, so a bad preset is refused at once, never at request time. Keys TabbyAPI
knows that this server has no sampler for are skipped with a warning; any other key is an error.
"""

from __future__ import annotations

import copy
import logging
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import InvalidArgumentError
from .schemas import SamplingFields

log = logging.getLogger("exl2cpp.server")

# request fields that are not sampler settings
_NOT_SAMPLERS = {"model", "n", "stream", "stream_options", "user"}
# TabbyAPI preset keys this server has no setting for (skipped with a warning)
_TABBY_ONLY = {
    "adaptive_target",
    "adaptive_decay",
    "logprobs",
    "top_logprobs",
    "speculative_ngram",
    "cfg_scale",
    "negative_prompt",
    "generate_window",
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._ -]{0,127}$")


def folder_file(folder: str | Path, name: str, exts: tuple[str, ...]) -> Path | None:
    """``folder/name<ext>`` for the first ext that exists, or None; a name that is not one plain file name
    (``../x``, ``a/b``, ``.hidden``) is never looked up."""
    if not isinstance(name, str) or not _NAME.match(name) or "/" in name or "\\" in name or ".." in name:
        return None
    root = Path(folder).expanduser()
    return next((root / f"{name}{e}" for e in exts if (root / f"{name}{e}").is_file()), None)


def _names() -> dict[str, str]:
    """Every name a sampler field answers to -> its field name."""
    out: dict[str, str] = {}
    for name, f in SamplingFields.model_fields.items():
        if name in _NOT_SAMPLERS:
            continue
        out[name] = name
        alias = f.validation_alias
        for a in getattr(alias, "choices", []) or []:
            out[str(a)] = name
    return out


class Overrides:
    """The sampler overrides in effect (``selected_preset``: the file they came from, if any)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder).expanduser()
        self.selected_preset: str | None = None
        self.overrides: dict[str, dict[str, Any]] = {}  # as given (listed by /v1/sampling/override/list)
        self._rules: dict[str, tuple[Any, bool, bool]] = {}  # field -> (value, force, additive)

    def presets(self) -> list[str]:
        if not self.folder.is_dir():
            return []
        return sorted(p.stem for p in self.folder.iterdir() if p.suffix in (".yml", ".yaml") and p.is_file())

    def load_preset(self, name: str) -> None:
        """Switch to the preset file ``name`` (without .yml); FileNotFoundError when there is none."""
        import yaml

        path = folder_file(self.folder, name, (".yml", ".yaml"))
        if path is None:
            raise FileNotFoundError(name)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise InvalidArgumentError(f"sampler preset {name!r} ({path}) cannot be read: {exc}") from None
        self.set(data or {}, what=f"sampler preset {name!r}")
        self.selected_preset = name

    def set(self, data: Any, what: str = "sampler overrides") -> None:
        """Use the overrides in ``data`` ({field: {"override", "force"?, "additive"?}}); an empty dict clears them."""
        if not isinstance(data, dict):
            raise InvalidArgumentError(f"{what}: expected a mapping of sampler fields, got {type(data).__name__}")
        names = _names()
        rules: dict[str, tuple[Any, bool, bool]] = {}
        kept: dict[str, dict[str, Any]] = {}
        for key, entry in data.items():
            if key in _TABBY_ONLY:
                log.warning("%s: %r is not a setting of this server; skipped", what, key)
                continue
            field = names.get(key)
            if field is None:
                raise InvalidArgumentError(f"{what}: unknown sampler field {key!r}")
            if not isinstance(entry, dict) or "override" not in entry:
                raise InvalidArgumentError(
                    f"{what}: {key} must be a mapping with 'override' (and optional 'force', 'additive')"
                )
            bad = sorted(set(entry) - {"override", "force", "additive"})
            if bad:
                raise InvalidArgumentError(f"{what}: {key} has unknown key(s) {bad}")
            force, additive = entry.get("force", False), entry.get("additive", False)
            if not isinstance(force, bool) or not isinstance(additive, bool):
                raise InvalidArgumentError(f"{what}: {key}.force and {key}.additive must be true or false")
            value = entry["override"]
            if value is None:
                continue
            try:
                checked = SamplingFields.model_validate({key: value})
            except ValidationError as exc:
                first = exc.errors()[0]
                raise InvalidArgumentError(f"{what}: {key}: {first.get('msg')}") from None
            rules[field] = (getattr(checked, field), force, additive)
            kept[key] = {"override": value, "force": force, "additive": additive}
        self._rules, self.overrides, self.selected_preset = rules, kept, None

    def apply(self, body: SamplingFields) -> SamplingFields:
        """``body`` with the overrides applied: forced values replace the request's, additive lists go before
        the request's list, the others fill in what it did not send."""
        if not self._rules:
            return body
        sent = {f for f in body.model_fields_set if getattr(body, f) is not None}  # null is "not sent"
        update: dict[str, Any] = {}
        for field, (value, force, additive) in self._rules.items():
            value = copy.deepcopy(value)
            mine = getattr(body, field)
            if force:
                update[field] = value
                if field == "max_tokens" and "max_completion_tokens" in type(body).model_fields:
                    update["max_completion_tokens"] = None  # one setting in TabbyAPI: the forced value holds
            elif additive and isinstance(value, list) and field in sent:
                update[field] = value + (mine if isinstance(mine, list) else [mine])
            elif field not in sent:
                update[field] = value
        return body.model_copy(update=update)

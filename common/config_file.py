"""The config file named by ``FERRY_CONFIG``: MindIE's layout, read into the settings and written back from them.

The file has MindIE's layout (``deploy/ferry.json`` is a complete example)::

    {"ServerConfig": {"ipAddress": ..., "port": ..., "httpsEnabled": ..., "maxLinkNum": ...},
     "LogConfig": {"logFormat": ..., "logLevel": ...},
     "BackendConfig": {"redisUrl": ..., "device": ...,
                       "ScheduleConfig": {"maxBatchSize": ..., "maxIterTimes": ..., "maxQueueSize": ...},
                       "ModelDeployConfig": {"maxSeqLen": ..., "truncation": 0,
                                             "ModelConfig": [{"modelName": ..., "modelWeightPath": ...}]}}}

Each setting belongs to one section (declared on its field with :func:`spec`); the file is flattened to the
camelCase keys, so a flat object of those keys (the older form) is accepted too. An unknown key, in either
form, is an error that names it: a typo must not silently fall back to a default. A stock MindIE
``config.json`` is read as it is, but for the keys Ferry does not implement (:mod:`common.mindie_config`),
which the error names all at once.

The settings class is passed in (:mod:`common.settings` imports this module, not the reverse).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

from pydantic import AliasChoices, BaseModel
from pydantic_settings import PydanticBaseSettingsSource

from common import mindie_config

Section = Literal["ServerConfig", "LogConfig", "BackendConfig", "ScheduleConfig", "ModelDeployConfig"]
# Where each section sits in the nested file.
SECTION_PATHS: dict[str, tuple[str, ...]] = {
    "ServerConfig": ("ServerConfig",),
    "LogConfig": ("LogConfig",),
    "BackendConfig": ("BackendConfig",),
    "ScheduleConfig": ("BackendConfig", "ScheduleConfig"),
    "ModelDeployConfig": ("BackendConfig", "ModelDeployConfig"),
}


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the key at fault."""


class SettingKey(NamedTuple):
    """A setting as the config file knows it (keyed by its camelCase key): its section, env var and field."""

    section: str | None
    env: str
    field: str


def spec(section: Section | None, key: str, env: str, *aliases: str) -> dict[str, Any]:
    """Field options of one setting: its camelCase key (config file), its env var, its file section (None: the
    flat form and env only, e.g. the model of a single-model deployment), and the env names vLLM or TGI users
    set for the same thing (README "Coming from vLLM or TGI"), read as the env var is."""
    return {"validation_alias": AliasChoices(key, env, *aliases), "json_schema_extra": {"section": section, "env": env}}


def setting_keys(settings_cls: type[BaseModel]) -> dict[str, SettingKey]:
    """camelCase key -> its :class:`SettingKey`, from the field options (:func:`spec`) of ``settings_cls``."""
    result = {}
    for name, field in settings_cls.model_fields.items():
        extra = field.json_schema_extra
        assert isinstance(field.validation_alias, AliasChoices) and isinstance(extra, dict)
        key, section = field.validation_alias.choices[0], extra["section"]
        assert isinstance(key, str) and (section is None or isinstance(section, str))
        result[key] = SettingKey(section, str(extra["env"]), name)
    return result


def key_path(key: str, keys: Mapping[str, SettingKey]) -> str:
    """Where a camelCase key sits in the config file, e.g. ``BackendConfig.ScheduleConfig.maxBatchSize``."""
    section = keys[key].section if key in keys else None
    return ".".join([*SECTION_PATHS.get(section or "", ()), key])


def _unknown(path: str, key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean `{close[0]}`?)" if close else f"; known here: {', '.join(sorted(known))}"
    return f"unknown key `{path}`{hint}"


def _model_entries(value: Any, dotted: str, refused: list[str], model_wide: list[tuple[str, Any]]) -> Any:
    """``ModelConfig`` without the MindIE keys of its items: those Ferry does not implement go to ``refused``,
    those that are one Ferry setting for every model (``trustRemoteCode``) to ``model_wide``."""
    if not isinstance(value, list):
        return value  # the settings' validation names what is wrong
    entries = []
    for index, entry in enumerate(value):
        if isinstance(entry, dict):
            entry = dict(entry)
            for key in [key for key in entry if key in mindie_config.REFUSED["ModelConfig"]]:
                refused.append(mindie_config.refused_key(f"{dotted}[{index}].{key}", key))
                del entry[key]
            if "trustRemoteCode" in entry:
                model_wide.append((f"{dotted}[{index}].trustRemoteCode", entry.pop("trustRemoteCode")))
        entries.append(entry)
    return entries


@dataclasses.dataclass
class _SectionWalk:
    """The walk of :func:`flatten_config` over the sections of a config file: the settings found (``flat``),
    the keys at fault (``errors``), the MindIE keys Ferry does not implement (``refused``) and the per-model
    MindIE keys that are one Ferry setting (``model_wide``)."""

    keys: dict[str, SettingKey]
    flat: dict[str, Any] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    refused: list[str] = dataclasses.field(default_factory=list)
    model_wide: list[tuple[str, Any]] = dataclasses.field(default_factory=list)

    def walk(self, node: dict[str, Any], path: tuple[str, ...]) -> None:
        sections = {p[len(path)]: p for p in SECTION_PATHS.values() if len(p) > len(path) and p[: len(path)] == path}
        here = next((s for s, p in SECTION_PATHS.items() if p == path), None)
        fields = [key for key, (section, _, _) in self.keys.items() if here is not None and section == here]
        for key, value in node.items():
            dotted = ".".join((*path, key))
            if key in sections:
                if isinstance(value, dict):
                    self.walk(value, (*path, key))
                else:
                    self.errors.append(f"`{dotted}` must be a JSON object")
            elif key == "ModelConfig" and key in fields:
                self.flat[key] = _model_entries(value, dotted, self.refused, self.model_wide)
            elif key in fields:
                self.flat[key] = value
            elif key in mindie_config.REFUSED.get(here or "", ()):
                self.refused.append(mindie_config.refused_key(dotted, key))
            elif key not in mindie_config.IGNORED.get(here or "", ()):
                self.errors.append(_unknown(dotted, key, [*fields, *sections]))


def flatten_config(data: Any, settings_cls: type[BaseModel]) -> dict[str, Any]:
    """The config file's settings as one flat object of camelCase keys. Raises :class:`ConfigError` naming
    every key at fault at once: unknown or in the wrong section (with a did-you-mean hint), a section that is
    not an object, and the keys of MindIE's config.json that Ferry does not implement (the user removes them
    in one pass); MindIE keys that change nothing in Ferry are skipped (:mod:`common.mindie_config`)."""
    if not isinstance(data, dict):
        raise ConfigError("the config file must hold a JSON object")
    keys = setting_keys(settings_cls)
    roots = {path[0] for path in SECTION_PATHS.values()}
    if not roots & data.keys():  # the flat form
        for key in data:
            if key not in keys:
                raise ConfigError(_unknown(key, key, list(keys)))
        return dict(data)
    found = _SectionWalk(keys)
    found.walk(data, ())
    flat, errors, refused, model_wide = found.flat, found.errors, found.refused, found.model_wide
    if model_wide:  # MindIE sets trustRemoteCode per model; Ferry's is one setting (BackendConfig)
        given = [value for _, value in model_wide] + ([flat["trustRemoteCode"]] if "trustRemoteCode" in flat else [])
        if any(value != given[0] for value in given):
            places = ", ".join(f"`{place}`" for place, _ in model_wide)
            errors.append(f"{places}: Ferry's trustRemoteCode is one setting for every model "
                          "(BackendConfig.trustRemoteCode); the values given differ")
        flat["trustRemoteCode"] = given[0]
    if refused:
        errors.append("keys of MindIE's config.json that Ferry does not implement; remove them (README "
                      f"\"Coming from MindIE\" says what Ferry has instead): {', '.join(refused)}")
    if errors:
        raise ConfigError("; ".join(errors))
    return flat


def nest_config(flat: Mapping[str, Any], settings_cls: type[BaseModel]) -> dict[str, Any]:
    """Settings by camelCase key in the config file's nested layout (the inverse of :func:`flatten_config`).
    The keys of no section (the flat form's ``modelName`` / ``modelWeightPath``) are left out: the nested file
    names its models in ``ModelConfig``."""
    keys = setting_keys(settings_cls)
    result: dict[str, Any] = {path[0]: {} for path in SECTION_PATHS.values()}
    for key, value in flat.items():
        section = keys[key].section
        if section is None:
            continue
        node = result
        for part in SECTION_PATHS[section]:
            node = node.setdefault(part, {})
        node[key] = value
    return result


class JsonConfigSource(PydanticBaseSettingsSource):
    """Reads the optional JSON config file named by FERRY_CONFIG (nested sections or flat keys)."""

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover
        raise NotImplementedError  # __call__ below does the work

    def __call__(self) -> dict[str, Any]:
        path = os.environ.get("FERRY_CONFIG")
        if not path:
            return {}
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"FERRY_CONFIG: cannot read {path}: {exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"FERRY_CONFIG: {path} is not valid JSON: {exc}") from None
        try:
            return flatten_config(data, self.settings_cls)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

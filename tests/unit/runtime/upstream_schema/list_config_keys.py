# SPDX-License-Identifier: Apache-2.0
"""List every config key upstream DeepSpeed's ``DeepSpeedConfig`` reads, as dotted paths, into
``upstream_config_keys.json`` beside this file. Run it with upstream's interpreter (read-only use of upstream):

    /work/upvenv/bin/python tests/unit/runtime/upstream_schema/list_config_keys.py

How the keys are found, without a hand-made list:

* a config is built from dicts that record every key looked up in them (``get``, ``[]``, ``in``), first empty,
  then with each key found so far present as such a dict (depth first, to any depth): the keys the section
  getters read;
* a section parsed by a pydantic model receives a probe key; the model class that receives it is recorded, and its
  fields (aliases included, nested models walked) are the section's keys. ``DeepSpeedConfigModel``'s ``__init__``
  is wrapped for that, in this process only.

Each entry: ``{"key": dotted path, "source": "getter" | "pydantic:<Class>", "default": repr of upstream's
default}``.
"""

import json
import os
import sys

PROBE = "__ds_probe__"
MAX_DEPTH = 4


class Recording(dict):
    """A dict that records the keys looked up in it into ``log`` (``prefix`` + key)."""

    def __init__(self, data, prefix, log):
        super().__init__(data)
        self.prefix, self.log = prefix, log

    def _seen(self, key, default="<absent>"):
        if isinstance(key, str) and key != PROBE:
            self.log.setdefault(self.prefix + key, default)

    def get(self, key, default=None):
        self._seen(key, default)
        return super().get(key, default)

    def __getitem__(self, key):
        self._seen(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._seen(key)
        return super().__contains__(key)

    def pop(self, key, *default):
        self._seen(key, default[0] if default else "<absent>")
        return super().pop(key, *default)

    def setdefault(self, key, default=None):
        self._seen(key, default)
        return super().setdefault(key, default)

    def keys(self):  # ``key in d.keys()`` is how several getters ask
        return _RecordingKeys(self)


class _RecordingKeys:

    def __init__(self, owner):
        self.owner = owner

    def __contains__(self, key):
        return key in self.owner

    def __iter__(self):
        return iter(dict.keys(self.owner))

    def __len__(self):
        return len(dict.keys(self.owner))


def _nest(path, leaf, log):
    """The top-level dict of a config whose ``path`` holds ``leaf`` (every level a Recording dict)."""
    parts = path.split(".") if path else []
    node = leaf
    for depth in range(len(parts), 0, -1):
        prefix = ".".join(parts[:depth - 1])
        node = Recording({parts[depth - 1]: node}, prefix + "." if prefix else "", log)
    return node


def _base(log):
    return Recording({"train_micro_batch_size_per_gpu": 1}, "", log)


def build(config):
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig(config)
    except BaseException:  # a probe that is not a valid value: what was read before the error still counts
        pass


def main():
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel
    models = {}  # dotted path of a probed section -> pydantic class that received the probe
    current = [None]
    original_init = DeepSpeedConfigModel.__init__

    def probing_init(self, strict=False, **data):
        if PROBE in data and current[0] is not None:
            models.setdefault(current[0], type(self))
        return original_init(self, strict=strict, **data)

    DeepSpeedConfigModel.__init__ = probing_init
    import logging
    logging.disable(logging.CRITICAL)

    found = {}
    log = {}
    config = _base(log)
    build(config)
    found.update(log)
    frontier = [k for k in log if k != "train_micro_batch_size_per_gpu"]
    probed = set()
    while frontier:
        path = frontier.pop(0)
        if path in probed or path.count(".") >= MAX_DEPTH:
            continue
        probed.add(path)
        log = {}
        leaf = Recording({PROBE: 1}, path + ".", log)
        config = _nest(path, leaf, log)
        config = Recording(dict(config, train_micro_batch_size_per_gpu=1), "", log)
        current[0] = path
        build(config)
        current[0] = None
        for key, default in log.items():
            if key not in found:
                found[key] = default
                if key.startswith(path + "."):
                    frontier.append(key)
    entries = {key: dict(key=key, source="getter", default=repr(default)) for key, default in found.items()}

    def walk(cls, prefix):
        for name, field in cls.model_fields.items():
            names = {name} | ({field.alias} if field.alias else set())
            annotation = field.annotation
            nested = _model_in(annotation, DeepSpeedConfigModel)
            for spelled in names:
                key = f"{prefix}.{spelled}"
                entries[key] = dict(key=key, source=f"pydantic:{cls.__name__}", default=repr(field.default))
                if nested is not None:
                    walk(nested, key)

    for path, cls in models.items():
        entries.pop(path + "." + PROBE, None)
        walk(cls, path)
    rows = sorted(entries.values(), key=lambda row: row["key"])
    import deepspeed
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_config_keys.json")
    with open(out, "w") as handle:
        json.dump({"deepspeed_version": deepspeed.__version__, "keys": rows}, handle, indent=1)
        handle.write("\n")
    print(f"{len(rows)} keys of deepspeed {deepspeed.__version__} -> {out}", file=sys.stderr)


def _model_in(annotation, base):
    """The pydantic model class inside ``annotation`` (``Optional[X]``, ``X``), or None."""
    import typing
    candidates = [annotation] + list(typing.get_args(annotation))
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, base):
            return candidate
    return None


if __name__ == "__main__":
    main()

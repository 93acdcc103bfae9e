"""``model.engine = "sglang"``: Tessera's generation node on SGLang's model runner (docs/sglang.md).

Importing this package registers the engine; SGLang itself is imported only when the engine
is built, so the package imports (and type-checks) without SGLang installed.
"""

from tessera.engines.sglang.engine import SGLangEngine

__all__ = ["SGLangEngine"]

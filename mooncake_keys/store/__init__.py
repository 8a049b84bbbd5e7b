"""Where the keys are asked: an in-process store, the Mooncake client adapter, and a local
``mooncake_master`` to run it against. Only :mod:`.memory` is imported eagerly; the rest loads
the Mooncake client lazily, on first use."""

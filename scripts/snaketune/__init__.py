"""snaketune: the library behind the Snakemake workflow (all logic lives here).

Loading it defers the ``torch.compile`` calls bitsandbytes and DeepSpeed's Muon optimizer make
as they load to their first use (snaketune.core.imports): peft imports bitsandbytes wherever
it is installed and not hidden, and every ``deepspeed.initialize`` with ZeRO imports Muon;
and scipy's optimizers, which transformers' object-detection losses import with every model.
"""

from snaketune.core.imports import defer_at_import

__version__ = "0.2.0"  # a release: CHANGELOG.md and a tag v<version> (docs/releases.md)

defer_at_import()

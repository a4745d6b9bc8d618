"""From checkpoints to models: DeepSpeed ZeRO shards to a Hugging Face folder, LoRA adapters
and their merge, the Hub upload. Imports the core, data and the methods."""

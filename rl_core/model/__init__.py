"""The policy model: loading and saving it and the project's tiny causal LM (`loading`), LoRA through PEFT (`lora`),
and what a model can do beyond a plain causal LM with the per-token inputs that serve it (`protocol`: capabilities;
`routing`: mixture-of-experts routes, recorded and replayed)."""

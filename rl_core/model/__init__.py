"""What a policy model can do beyond a plain causal LM, and the per-token model inputs that serve it
(`protocol`: capabilities; `routing`: mixture-of-experts routes, recorded and replayed)."""

"""Sketched NTK features Φ with E[Φ1 Φ2ᵀ] = Θ: the Gaussian and the structured (Kronecker) sketch and their seeded
draws."""

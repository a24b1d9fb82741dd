//! Nothing here: the crate exists for `tests/ui.rs`, whose trybuild cases compile against
//! `kiln` with no default features (the macros, traits and registries, without candle).

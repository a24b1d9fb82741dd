//! Link-time collection of registry entries.
//!
//! With the default build the macros emit `linkme` distributed-slice elements; with feature
//! `inventory` they emit `inventory::submit!` (for targets without linker sections). Only a
//! crate that is linked contributes entries: a plugin crate that nothing references is
//! dropped by the linker, so applications write `use my_plugins as _;`.
//!
//! Each registry kind declares its collection beside its entry type with [`collection!`]; this
//! module knows none of them.

/// Declares the link-time collection of one entry type: the `linkme` slice `$slice` (or the
/// `inventory` collection), and `collected()`, every entry linked into the program, in link
/// order (arbitrary).
macro_rules! collection {
    ($(#[$doc:meta])* $slice:ident: $entry:ty) => {
        $(#[$doc])*
        #[cfg(not(feature = "inventory"))]
        #[linkme::distributed_slice]
        pub static $slice: [$entry];

        #[cfg(feature = "inventory")]
        inventory::collect!($entry);

        /// Every entry of this kind linked into the program, in link order (arbitrary).
        pub(crate) fn collected() -> Vec<$entry> {
            #[cfg(not(feature = "inventory"))]
            {
                $slice.to_vec()
            }
            #[cfg(feature = "inventory")]
            {
                inventory::iter::<$entry>.into_iter().cloned().collect()
            }
        }
    };
}
pub(crate) use collection;

/// The collection mechanism this build uses: "linkme" or "inventory".
pub const MECHANISM: &str = if cfg!(feature = "inventory") {
    "inventory"
} else {
    "linkme"
};

//! The reward registry: named reward functions for GRPO, registered with
//! `#[reward(name = "...")]` on a function in any crate and chosen with `reward_funcs`.

use crate::registry::{EntryMeta, Named, RegistryEntry, RegistryError, RegistryIssue};
use std::borrow::Cow;
use std::fmt;

crate::registry::collect::collection!(
    /// Every `#[reward]` entry linked into the program.
    REWARDS: RewardEntry
);

/// What a reward function sees of one completion.
#[derive(Debug, Clone, Copy)]
pub struct RewardInput<'a> {
    /// The prompt text.
    pub prompt: &'a str,
    /// The completion text (special tokens dropped).
    pub completion: &'a str,
    /// The completion's token ids (the EOS included when it stopped there).
    pub completion_ids: &'a [u32],
    /// Every column of the example (`answer`, …).
    pub example: &'a serde_json::Map<String, serde_json::Value>,
    /// The run's task settings (a reward's own parameters: `reward_regex`, …).
    pub options: &'a serde_json::Map<String, serde_json::Value>,
}

/// A reward: a score for one completion, or `None` where it does not apply (TRL's `None`,
/// averaged over as NaN).
pub type RewardFn = fn(&RewardInput<'_>) -> Option<f64>;

/// One registered reward function.
#[derive(Clone)]
pub struct RewardEntry {
    /// Identity and source location.
    pub meta: EntryMeta,
    /// The name users give in `reward_funcs`.
    pub name: Cow<'static, str>,
    /// The function.
    pub func: RewardFn,
}

impl fmt::Debug for RewardEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RewardEntry")
            .field("path", &self.meta.path)
            .field("name", &self.name)
            .field("location", &self.meta.location)
            .finish()
    }
}

/// The registered reward functions, by name.
pub type RewardRegistry = Named<RewardEntry>;

impl RegistryEntry for RewardEntry {
    const KIND: &'static str = "reward";
    type Registry = RewardRegistry;

    fn meta(&self) -> &EntryMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut EntryMeta {
        &mut self.meta
    }
    fn collected() -> Vec<Self> {
        collected()
    }
    fn assemble(entries: Vec<Self>) -> Result<RewardRegistry, Vec<RegistryIssue>> {
        Named::assemble(
            entries,
            |e| e.name.as_ref(),
            |name| format!("named '{name}'"),
            "rename one",
        )
    }
}

impl Named<RewardEntry> {
    /// The link-time registry, validated on first use.
    pub fn try_global() -> Result<&'static RewardRegistry, &'static RegistryError> {
        static GLOBAL: std::sync::LazyLock<Result<RewardRegistry, RegistryError>> =
            std::sync::LazyLock::new(crate::registry::build_static::<RewardEntry>);
        GLOBAL.as_ref()
    }
}

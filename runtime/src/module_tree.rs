//! The module tree: a model as a hierarchy of named modules, each with a class chain.
//!
//! A module's *class chain* lists its class and the classes it stands in for, most specific
//! first — the analogue of Python's MRO, e.g. `["QuantLinear", "Linear"]`. Exporters match on
//! it by class name (string keys) or by Rust type (type keys, through [`ModuleClass`]).

use std::any::TypeId;
use std::borrow::Cow;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// A Rust type that stands for a module class, so exporters can key on it by type.
pub trait ModuleClass: 'static {
    /// The class name, as Hugging Face / PyTorch spell it (`"Linear"`).
    const NAME: &'static str;
}

macro_rules! builtin_classes {
    ($($(#[$doc:meta])* $ty:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, Default)]
        pub struct $ty;
        impl ModuleClass for $ty {
            const NAME: &'static str = stringify!($ty);
        }
    )*};
}

builtin_classes! {
    /// `torch.nn.Linear`: a 2-D `weight` `[out, in]` and an optional `bias`.
    Linear,
    /// `torch.nn.Embedding`: a 2-D `weight` `[vocab, hidden]`.
    Embedding,
    /// `torch.nn.Module`: the root of every chain.
    Module,
}

/// One class in a chain: a name and, for Rust-typed classes, its `TypeId`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Class {
    name: Cow<'static, str>,
    type_id: Option<TypeId>,
}

impl Class {
    /// The class of a Rust type.
    pub fn of<T: ModuleClass>() -> Self {
        Class {
            name: Cow::Borrowed(T::NAME),
            type_id: Some(TypeId::of::<T>()),
        }
    }

    /// A class known only by name (for example one read from a checkpoint's config).
    pub fn named(name: impl Into<Cow<'static, str>>) -> Self {
        Class {
            name: name.into(),
            type_id: None,
        }
    }

    /// The class name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The Rust type, when the class has one.
    pub fn type_id(&self) -> Option<TypeId> {
        self.type_id
    }
}

/// A class chain, most specific class first. Cheap to clone; hashing uses a hash computed
/// once at construction, so a per-chain cache lookup costs one probe.
#[derive(Clone)]
pub struct ClassChain(Arc<ChainInner>);

struct ChainInner {
    classes: Box<[Class]>,
    hash: u64,
}

impl ClassChain {
    /// A chain from its classes, most specific first.
    pub fn new(classes: impl IntoIterator<Item = Class>) -> Self {
        let classes: Box<[Class]> = classes.into_iter().collect();
        let mut h = rustc_hash::FxHasher::default();
        classes.hash(&mut h);
        ClassChain(Arc::new(ChainInner {
            hash: h.finish(),
            classes,
        }))
    }

    /// The classes, most specific first.
    pub fn classes(&self) -> &[Class] {
        &self.0.classes
    }

    /// The most specific class name (`""` for an empty chain).
    pub fn name(&self) -> &str {
        self.0.classes.first().map_or("", |c| c.name())
    }

    /// Whether any class in the chain has this name.
    pub fn has_name(&self, name: &str) -> bool {
        self.0.classes.iter().any(|c| c.name == name)
    }

    /// Whether any class in the chain is the Rust type `T`.
    pub fn is<T: ModuleClass>(&self) -> bool {
        let id = TypeId::of::<T>();
        self.0.classes.iter().any(|c| c.type_id == Some(id))
    }
}

impl PartialEq for ClassChain {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
            || (self.0.hash == other.0.hash && self.0.classes == other.0.classes)
    }
}
impl Eq for ClassChain {}

impl Hash for ClassChain {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0.hash);
    }
}

impl fmt::Debug for ClassChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.0.classes.iter().map(|c| c.name()))
            .finish()
    }
}

impl fmt::Display for ClassChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.0.classes.iter().map(|c| c.name()).collect();
        write!(f, "{}", names.join(" < "))
    }
}

/// A tensor a module owns directly: its local name (`weight`), shape and dtype name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// The local name (`weight`).
    pub name: String,
    /// The shape.
    pub shape: Vec<usize>,
    /// The dtype name (`BF16`).
    pub dtype: String,
}

#[derive(Debug, Clone)]
struct Node {
    path: String,
    local: String,
    parent: Option<usize>,
    children: Vec<usize>,
    chain: ClassChain,
    tensors: Vec<TensorInfo>,
}

/// A model's modules in insertion order; node 0 is the root (path `""`).
#[derive(Debug, Clone)]
pub struct ModuleTree {
    nodes: Vec<Node>,
    generic: ClassChain,
}

impl Default for ModuleTree {
    fn default() -> Self {
        Self::new(ClassChain::new([Class::of::<Module>()]))
    }
}

/// An error building a module tree.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModuleTreeError {
    /// A module path was added twice.
    #[error("module `{0}` is defined twice")]
    DuplicateModule(String),
    /// A module path has an empty segment (`a..b`, a leading or trailing dot).
    #[error("module path `{0}` has an empty segment")]
    EmptySegment(String),
}

impl ModuleTree {
    /// An empty tree whose root (and any implicitly created parent) has class `generic`.
    pub fn new(generic: ClassChain) -> Self {
        let root = Node {
            path: String::new(),
            local: String::new(),
            parent: None,
            children: Vec::new(),
            chain: generic.clone(),
            tensors: Vec::new(),
        };
        ModuleTree {
            nodes: vec![root],
            generic,
        }
    }

    /// Adds the module at `path` (dot-separated) with its class chain and tensors, creating
    /// missing parents with the generic class. A parent created implicitly may later be
    /// defined explicitly, once.
    pub fn add(
        &mut self,
        path: &str,
        chain: ClassChain,
        tensors: Vec<TensorInfo>,
    ) -> Result<ModuleRef<'_>, ModuleTreeError> {
        if path.is_empty() {
            let root = &mut self.nodes[0];
            root.chain = chain;
            root.tensors = tensors;
            return Ok(self.get(0));
        }
        if path.split('.').any(str::is_empty) {
            return Err(ModuleTreeError::EmptySegment(path.to_string()));
        }
        let mut at = 0;
        let mut created_last = false;
        for (end, _) in path.match_indices('.').chain([(path.len(), "")]) {
            let prefix = &path[..end];
            let local = &prefix[prefix.rfind('.').map_or(0, |i| i + 1)..];
            match self.nodes[at]
                .children
                .iter()
                .copied()
                .find(|&c| self.nodes[c].local == local)
            {
                Some(c) => {
                    at = c;
                    created_last = false;
                }
                None => {
                    let id = self.nodes.len();
                    self.nodes.push(Node {
                        path: prefix.to_string(),
                        local: local.to_string(),
                        parent: Some(at),
                        children: Vec::new(),
                        chain: self.generic.clone(),
                        tensors: Vec::new(),
                    });
                    self.nodes[at].children.push(id);
                    at = id;
                    created_last = true;
                }
            }
        }
        let node = &mut self.nodes[at];
        let implicit = node.tensors.is_empty() && node.chain == self.generic;
        if !created_last && !implicit {
            return Err(ModuleTreeError::DuplicateModule(path.to_string()));
        }
        node.chain = chain;
        node.tensors = tensors;
        Ok(self.get(at))
    }

    /// The root module.
    pub fn root(&self) -> ModuleRef<'_> {
        self.get(0)
    }

    /// The module at `path`, if any.
    pub fn find(&self, path: &str) -> Option<ModuleRef<'_>> {
        if path.is_empty() {
            return Some(self.root());
        }
        let mut at = 0;
        for seg in path.split('.') {
            at = self.nodes[at]
                .children
                .iter()
                .copied()
                .find(|&c| self.nodes[c].local == seg)?;
        }
        Some(self.get(at))
    }

    /// Every module in pre-order (a parent before its children, children in insertion order),
    /// the root first — the order of PyTorch's `named_modules()`.
    pub fn walk(&self) -> impl Iterator<Item = ModuleRef<'_>> + '_ {
        let mut stack = vec![0usize];
        std::iter::from_fn(move || {
            let id = stack.pop()?;
            stack.extend(self.nodes[id].children.iter().rev());
            Some(self.get(id))
        })
    }

    /// The number of modules, the root included.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the tree holds only its root.
    pub fn is_empty(&self) -> bool {
        self.nodes.len() == 1
    }

    fn get(&self, id: usize) -> ModuleRef<'_> {
        ModuleRef { tree: self, id }
    }
}

/// A view of one module in a [`ModuleTree`]: what exporters and predicates see.
#[derive(Clone, Copy)]
pub struct ModuleRef<'a> {
    tree: &'a ModuleTree,
    id: usize,
}

impl<'a> ModuleRef<'a> {
    fn node(&self) -> &'a Node {
        &self.tree.nodes[self.id]
    }

    /// The full dotted path (`model.layers.0.mlp`); `""` for the root.
    pub fn path(&self) -> &'a str {
        &self.node().path
    }

    /// The last path segment (`mlp`).
    pub fn local_name(&self) -> &'a str {
        &self.node().local
    }

    /// The class chain, most specific first.
    pub fn class_chain(&self) -> &'a ClassChain {
        &self.node().chain
    }

    /// The most specific class name.
    pub fn class_name(&self) -> &'a str {
        self.node().chain.name()
    }

    /// The tensors the module owns directly.
    pub fn tensors(&self) -> &'a [TensorInfo] {
        &self.node().tensors
    }

    /// The tensor with this local name (`weight`).
    pub fn tensor(&self, name: &str) -> Option<&'a TensorInfo> {
        self.node().tensors.iter().find(|t| t.name == name)
    }

    /// The direct children, in insertion order.
    pub fn children(&self) -> impl Iterator<Item = ModuleRef<'a>> + 'a {
        let tree = self.tree;
        self.node()
            .children
            .iter()
            .map(move |&id| ModuleRef { tree, id })
    }

    /// The direct child with this local name (`experts`).
    pub fn child(&self, name: &str) -> Option<ModuleRef<'a>> {
        self.children().find(|c| c.local_name() == name)
    }

    /// The parent module (`None` for the root).
    pub fn parent(&self) -> Option<ModuleRef<'a>> {
        self.node().parent.map(|id| ModuleRef {
            tree: self.tree,
            id,
        })
    }
}

impl fmt::Debug for ModuleRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModuleRef")
            .field("path", &self.path())
            .field("class_chain", self.class_chain())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(names: &[&'static str]) -> ClassChain {
        ClassChain::new(names.iter().map(|n| Class::named(*n)))
    }

    #[test]
    fn walk_is_preorder_in_insertion_order() {
        let mut t = ModuleTree::default();
        t.add("model.layers.0.mlp.up_proj", chain(&["Linear"]), vec![])
            .unwrap();
        t.add(
            "model.layers.0.self_attn.q_proj",
            chain(&["Linear"]),
            vec![],
        )
        .unwrap();
        t.add("model.layers.0.mlp.down_proj", chain(&["Linear"]), vec![])
            .unwrap();
        t.add("lm_head", chain(&["Linear"]), vec![]).unwrap();
        let order: Vec<&str> = t.walk().map(|m| m.path()).collect();
        assert_eq!(
            order,
            [
                "",
                "model",
                "model.layers",
                "model.layers.0",
                "model.layers.0.mlp",
                "model.layers.0.mlp.up_proj",
                "model.layers.0.mlp.down_proj",
                "model.layers.0.self_attn",
                "model.layers.0.self_attn.q_proj",
                "lm_head"
            ]
        );
    }

    #[test]
    fn implicit_parent_can_be_defined_once_then_duplicates_error() {
        let mut t = ModuleTree::default();
        t.add("a.b", chain(&["Linear"]), vec![]).unwrap();
        t.add("a", chain(&["Block"]), vec![]).unwrap();
        assert_eq!(t.find("a").unwrap().class_name(), "Block");
        assert_eq!(
            t.add("a", chain(&["Block"]), vec![]).unwrap_err(),
            ModuleTreeError::DuplicateModule("a".into())
        );
        assert_eq!(
            t.add("a.b", chain(&["Linear"]), vec![]).unwrap_err(),
            ModuleTreeError::DuplicateModule("a.b".into())
        );
        assert_eq!(
            t.add("a..c", chain(&["X"]), vec![]).unwrap_err(),
            ModuleTreeError::EmptySegment("a..c".into())
        );
    }

    #[test]
    fn chains_compare_by_content_and_know_their_types() {
        let a = ClassChain::new([Class::named("QuantLinear"), Class::of::<Linear>()]);
        let b = ClassChain::new([Class::named("QuantLinear"), Class::of::<Linear>()]);
        let c = ClassChain::new([Class::named("QuantLinear"), Class::named("Linear")]);
        assert_eq!(a, b);
        assert_ne!(
            a, c,
            "a named class is not the typed class of the same name"
        );
        assert!(a.is::<Linear>() && !c.is::<Linear>());
        assert!(c.has_name("Linear"));
        assert_eq!(a.to_string(), "QuantLinear < Linear");
    }
}

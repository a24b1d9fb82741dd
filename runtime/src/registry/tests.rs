//! The registry rules, on hand-made entries (no linking involved).

use super::*;
use crate::architecture::registry::ArchitectureEntry;
use crate::export::registry::{ExporterEntry, Key, Predicate, PredicateFn};
use crate::module_tree::{
    Class, ClassChain, Embedding, Linear, ModuleClass, ModuleRef, ModuleTree,
};
use crate::train::registry::{RouteError, TrainerEntry};
use crate::{ModuleExporter, TrainConfig, TrainError, TrainObserver, TrainReport, Trainer};
use proptest::prelude::*;
use std::any::TypeId;

struct Nop;
impl ModuleExporter for Nop {}

struct QuantLinear;
impl ModuleClass for QuantLinear {
    const NAME: &'static str = "QuantLinear";
}

fn loc(line: u32) -> SourceLocation {
    SourceLocation {
        file: "src/test.rs",
        line,
    }
}

fn meta(path: &str, tier: Tier, priority: i32, line: u32) -> EntryMeta {
    EntryMeta {
        path: Cow::Owned(path.to_string()),
        type_id: None,
        tier,
        priority,
        replaces: None,
        location: loc(line),
    }
}

fn exporter(
    path: &str,
    tier: Tier,
    priority: i32,
    keys: Vec<Key>,
    predicate: Option<PredicateFn>,
) -> ExporterEntry {
    ExporterEntry {
        meta: meta(path, tier, priority, 1),
        keys: Cow::Owned(keys),
        predicate: predicate.map(|func| Predicate {
            func,
            name: Cow::Borrowed("pred"),
        }),
        construct: || Box::new(Nop),
    }
}

fn paths(r: &crate::export::registry::ExporterRegistry) -> Vec<&str> {
    r.entries().iter().map(|e| e.meta.path.as_ref()).collect()
}

#[test]
fn static_order_is_tier_then_priority_then_path_whatever_the_link_order() {
    let make = || {
        vec![
            exporter(
                "z::Fallback",
                Tier::Fallback,
                100,
                vec![Key::name("X")],
                None,
            ),
            exporter("b::Normal", Tier::Normal, 0, vec![Key::name("X")], None),
            exporter("a::Normal", Tier::Normal, 0, vec![Key::name("X")], None),
            exporter("c::High", Tier::Normal, 5, vec![Key::name("X")], None),
            exporter("y::Prepend", Tier::Prepend, -3, vec![Key::name("X")], None),
            exporter(
                "x::PrependHigh",
                Tier::Prepend,
                1,
                vec![Key::name("X")],
                None,
            ),
        ]
    };
    let expected = [
        "x::PrependHigh",
        "y::Prepend",
        "c::High",
        "a::Normal",
        "b::Normal",
        "z::Fallback",
    ];
    let mut entries = make();
    for rotation in 0..entries.len() {
        entries.rotate_left(1);
        let mut reversed = entries.clone();
        reversed.reverse();
        for order in [entries.clone(), reversed] {
            let r = build_from_collected(order).unwrap();
            assert_eq!(paths(&r), expected, "rotation {rotation}");
        }
    }
}

#[test]
fn duplicate_identity_is_reported_with_both_locations() {
    let mut a = exporter("p::Same", Tier::Normal, 0, vec![Key::name("X")], None);
    let mut b = a.clone();
    a.meta.location = loc(10);
    b.meta.location = loc(20);
    let err = build_from_collected(vec![b, a]).unwrap_err();
    assert_eq!(
        err.issues,
        [RegistryIssue::DuplicateIdentity {
            kind: "exporter",
            path: "p::Same".into(),
            first: loc(10),
            second: loc(20)
        }]
    );
    let text = err.to_string();
    assert!(
        text.contains("src/test.rs:10") && text.contains("src/test.rs:20"),
        "{text}"
    );
}

struct TypeA;
impl ModuleExporter for TypeA {}
struct TypeB;
impl ModuleExporter for TypeB {}
struct TypeC;
impl ModuleExporter for TypeC {}

fn typed(path: &str, id: fn() -> TypeId, replaces: Option<Replaces>, line: u32) -> ExporterEntry {
    let mut e = exporter(path, Tier::Normal, 0, vec![Key::name("X")], None);
    e.meta.type_id = Some(id);
    e.meta.replaces = replaces;
    e.meta.location = loc(line);
    e
}

#[test]
fn replaces_removes_the_named_entry() {
    let r = build_from_collected(vec![
        typed("m::A", TypeId::of::<TypeA>, None, 1),
        typed(
            "m::B",
            TypeId::of::<TypeB>,
            Some(Replaces {
                type_id: TypeId::of::<TypeA>,
                written: "A",
            }),
            2,
        ),
    ])
    .unwrap();
    assert_eq!(paths(&r), ["m::B"]);
}

#[test]
fn replaces_naming_nothing_itself_or_twice_are_errors() {
    let err = build_from_collected(vec![typed(
        "m::B",
        TypeId::of::<TypeB>,
        Some(Replaces {
            type_id: TypeId::of::<TypeA>,
            written: "other::A",
        }),
        7,
    )])
    .unwrap_err();
    assert_eq!(
        err.issues,
        [RegistryIssue::ReplacesUnknown {
            kind: "exporter",
            path: "m::B".into(),
            location: loc(7),
            target: "other::A".into()
        }]
    );

    let err = build_from_collected(vec![typed(
        "m::A",
        TypeId::of::<TypeA>,
        Some(Replaces {
            type_id: TypeId::of::<TypeA>,
            written: "A",
        }),
        3,
    )])
    .unwrap_err();
    assert!(matches!(
        err.issues[..],
        [RegistryIssue::ReplacesItself { .. }]
    ));

    let err = build_from_collected(vec![
        typed("m::A", TypeId::of::<TypeA>, None, 1),
        typed(
            "m::B",
            TypeId::of::<TypeB>,
            Some(Replaces {
                type_id: TypeId::of::<TypeA>,
                written: "A",
            }),
            2,
        ),
        typed(
            "m::C",
            TypeId::of::<TypeC>,
            Some(Replaces {
                type_id: TypeId::of::<TypeA>,
                written: "A",
            }),
            3,
        ),
    ])
    .unwrap_err();
    assert_eq!(
        err.issues,
        [RegistryIssue::ReplacedTwice {
            kind: "exporter",
            target: "m::A".into(),
            first: "m::B".into(),
            first_at: loc(2),
            second: "m::C".into(),
            second_at: loc(3)
        }]
    );
}

struct T1;
struct T2;
impl Trainer for T1 {
    fn new(_: &TrainConfig) -> Result<Self, TrainError> {
        Ok(T1)
    }
    fn train(&mut self, _: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
        unreachable!("not trained in these tests")
    }
}
impl Trainer for T2 {
    fn new(_: &TrainConfig) -> Result<Self, TrainError> {
        Ok(T2)
    }
    fn train(&mut self, _: &mut dyn TrainObserver) -> Result<TrainReport, TrainError> {
        unreachable!("not trained in these tests")
    }
}

fn trainer(path: &str, task: &str, backend: &str, line: u32) -> TrainerEntry {
    let mut e = TrainerEntry::of::<T1>(task, backend);
    e.meta.path = Cow::Owned(path.to_string());
    e.meta.location = loc(line);
    e
}

#[test]
fn two_trainers_for_one_route_conflict_unless_one_replaces_the_other() {
    let err = build_from_collected(vec![
        trainer("b::Two", "sft", "candle", 9),
        trainer("a::One", "sft", "candle", 4),
    ])
    .unwrap_err();
    assert_eq!(
        err.issues,
        [RegistryIssue::NameConflict {
            kind: "trainer",
            claim: "for task 'sft' on backend 'candle'".into(),
            first: "a::One".into(),
            first_at: loc(4),
            second: "b::Two".into(),
            second_at: loc(9),
            fix: "mark one `replaces = <the other>`",
        }]
    );

    let mut one = TrainerEntry::of::<T1>("sft", "candle");
    let mut two = TrainerEntry::of::<T2>("sft", "candle");
    one.meta.location = loc(1);
    two.meta.replaces = Some(Replaces {
        type_id: TypeId::of::<T1>,
        written: "T1",
    });
    let r = build_from_collected(vec![one, two]).unwrap();
    assert_eq!(
        r.resolve("sft", "candle").unwrap().meta.type_id.unwrap()(),
        TypeId::of::<T2>()
    );
}

fn routes(list: &[(&str, &str)]) -> crate::train::registry::TrainerRegistry {
    let entries = list
        .iter()
        .enumerate()
        .map(|(i, (t, b))| trainer(&format!("t::T{i}"), t, b, i as u32))
        .collect();
    build_from_collected(entries).unwrap()
}

#[test]
fn routing_is_backend_first_with_the_exact_messages() {
    let mut list = vec![];
    for t in ["sft", "dpo", "orpo", "simpo", "kto", "grpo", "ppo"] {
        list.push((t, "candle"));
    }
    for t in ["simpo", "sft", "kto", "grpo", "orpo", "dpo"] {
        list.push((t, "mlx"));
    }
    let r = routes(&list);
    assert_eq!(
        r.resolve("ppo", "mlx").unwrap_err().to_string(),
        "backend 'mlx' does not support task 'ppo'. Supported: dpo, grpo, kto, orpo, sft, simpo. \
         Use backend=candle for full task coverage."
    );
    assert_eq!(
        r.resolve("sft", "tpu").unwrap_err().to_string(),
        "unknown backend 'tpu'. Known backends: candle, mlx."
    );
    assert_eq!(r.resolve("sft", "mlx").unwrap().backend, "mlx");
    // The full-coverage backend itself gets no hint.
    assert_eq!(
        r.resolve("rlhf", "candle").unwrap_err().to_string(),
        "backend 'candle' does not support task 'rlhf'. Supported: dpo, grpo, kto, orpo, ppo, sft, simpo."
    );
}

#[test]
fn full_coverage_prefers_the_most_tasks_then_candle_on_a_tie() {
    assert_eq!(
        routes(&[("a", "candle"), ("a", "zeta"), ("b", "zeta")])
            .full_coverage_backend()
            .as_deref(),
        Some("zeta")
    );
    assert_eq!(
        routes(&[("a", "zeta"), ("a", "candle")])
            .full_coverage_backend()
            .as_deref(),
        Some("candle")
    );
    assert_eq!(
        routes(&[("a", "zeta"), ("a", "beta")])
            .full_coverage_backend()
            .as_deref(),
        Some("beta")
    );
    assert_eq!(routes(&[]).full_coverage_backend(), None);
}

#[test]
fn a_builtin_backend_compiled_out_names_its_feature() {
    let r = routes(&[("sft", "candle")]);
    let err = r.resolve("sft", "mlx").unwrap_err();
    if cfg!(feature = "mlx") {
        assert!(matches!(err, RouteError::UnsupportedTask { .. }), "{err}");
    } else {
        assert_eq!(
            err.to_string(),
            "backend 'mlx' is not available: kiln was built without the 'mlx' feature (rebuild with `--features mlx`)"
        );
    }
    // A built backend without trainers says which tasks it has: none.
    let empty = routes(&[("sft", "zeta")]);
    assert_eq!(
        empty.resolve("sft", "candle").unwrap_err().to_string(),
        "backend 'candle' does not support task 'sft'. Supported: none. Use backend=zeta for full task coverage."
    );
}

#[test]
fn architectures_resolve_by_name_then_fallback_and_conflict_on_shared_names() {
    fn arch(path: &str, names: &[&'static str], tier: Tier, line: u32) -> ArchitectureEntry {
        struct A;
        impl crate::Architecture for A {
            fn module_tree(
                &self,
                _: &serde_json::Value,
                _: &[crate::TensorInfo],
            ) -> Result<ModuleTree, crate::ArchitectureError> {
                Ok(ModuleTree::default())
            }
        }
        ArchitectureEntry {
            meta: meta(path, tier, 0, line),
            names: Cow::Owned(names.iter().map(|n| Cow::Borrowed(*n)).collect()),
            construct: || Box::new(A),
        }
    }
    let r = build_from_collected(vec![
        arch(
            "a::Llama",
            &["LlamaForCausalLM", "MistralForCausalLM"],
            Tier::Normal,
            1,
        ),
        arch("a::Generic", &[], Tier::Fallback, 2),
    ])
    .unwrap();
    use crate::architecture::registry::ArchitectureMatch::*;
    assert!(matches!(r.resolve("MistralForCausalLM"), Some(Named(e)) if e.meta.path == "a::Llama"));
    assert!(
        matches!(r.resolve("NewForCausalLM"), Some(Fallback(e)) if e.meta.path == "a::Generic")
    );

    let err = build_from_collected(vec![
        arch("a::Llama", &["LlamaForCausalLM"], Tier::Normal, 1),
        arch("b::Llama", &["LlamaForCausalLM"], Tier::Normal, 2),
    ])
    .unwrap_err();
    assert!(
        matches!(&err.issues[..], [RegistryIssue::NameConflict { claim, .. }] if claim == "for 'LlamaForCausalLM'")
    );
}

#[test]
fn builder_register_appends_and_replaces_in_place() {
    let mut b = RegistryBuilder::<ExporterEntry>::empty();
    b.register(exporter("a", Tier::Normal, 0, vec![Key::name("X")], None));
    b.register(exporter("b", Tier::Normal, 0, vec![Key::name("X")], None));
    b.register(exporter("c", Tier::Normal, 0, vec![Key::name("X")], None));
    // Same identity: replaced where it stands, with the new keys.
    b.register(exporter("a", Tier::Normal, 0, vec![Key::name("Y")], None));
    b.prepend(exporter("p", Tier::Normal, 0, vec![Key::name("X")], None));
    b.register(exporter("f", Tier::Fallback, 0, vec![Key::name("X")], None));
    b.register(exporter(
        "late",
        Tier::Normal,
        0,
        vec![Key::name("X")],
        None,
    ));
    b.register(exporter("hi", Tier::Normal, 3, vec![Key::name("X")], None));
    let r = b.build().unwrap();
    assert_eq!(paths(&r), ["p", "hi", "a", "b", "c", "late", "f"]);
    assert_eq!(r.entries()[2].keys[0].describe(), "\"Y\"");
    assert_eq!(r.entries()[0].meta.tier, Tier::Prepend);
}

#[test]
fn builder_replace_and_remove() {
    let mut b = RegistryBuilder::<ExporterEntry>::empty();
    for p in ["a", "b", "c"] {
        b.register(exporter(p, Tier::Normal, 0, vec![Key::name("X")], None));
    }
    b.replace(
        "b",
        exporter("n", Tier::Normal, 0, vec![Key::name("X")], None),
    )
    .unwrap();
    assert!(
        b.replace("zz", exporter("m", Tier::Normal, 0, vec![], None))
            .is_err()
    );
    assert!(b.remove("a"));
    assert!(!b.remove("a"));
    assert_eq!(paths(&b.build().unwrap()), ["n", "c"]);
}

#[test]
fn builder_validates_trainer_routes_at_build() {
    let mut b = RegistryBuilder::<TrainerEntry>::empty();
    b.register(trainer("x::A", "sft", "candle", 1));
    b.register(trainer("x::B", "sft", "candle", 2));
    assert!(matches!(
        &b.build().unwrap_err().issues[..],
        [RegistryIssue::NameConflict {
            kind: "trainer",
            ..
        }]
    ));
}

// ---- matching ----

fn tree_with(chains: &[(&str, ClassChain)]) -> ModuleTree {
    let mut t = ModuleTree::default();
    for (path, chain) in chains {
        t.add(path, chain.clone(), vec![]).unwrap();
    }
    t
}

fn always(_: &ModuleRef<'_>) -> bool {
    true
}
fn never(_: &ModuleRef<'_>) -> bool {
    false
}
fn is_proj(m: &ModuleRef<'_>) -> bool {
    m.local_name().ends_with("_proj")
}

#[test]
fn type_keys_match_by_type_id_and_name_keys_by_any_class_name() {
    let typed_chain = ClassChain::new([Class::of::<QuantLinear>(), Class::of::<Linear>()]);
    let named_chain = ClassChain::new([Class::named("QuantLinear"), Class::named("Linear")]);
    let tree = tree_with(&[("typed", typed_chain), ("named", named_chain)]);
    let mut b = RegistryBuilder::<ExporterEntry>::empty();
    b.register(exporter(
        "by_type",
        Tier::Normal,
        0,
        vec![Key::of_class::<Linear>()],
        None,
    ));
    b.register(exporter(
        "by_name",
        Tier::Normal,
        0,
        vec![Key::name("Linear")],
        None,
    ));
    let r = b.build().unwrap();
    let typed = tree.find("typed").unwrap();
    let named = tree.find("named").unwrap();
    assert_eq!(r.find(&typed).unwrap().entry.meta.path, "by_type");
    // A class known only by name is not the Rust type `Linear`: the type key misses.
    assert_eq!(r.find(&named).unwrap().entry.meta.path, "by_name");
}

#[test]
fn keys_are_ored_and_keys_with_a_predicate_need_both() {
    let tree = tree_with(&[
        ("m.q_proj", ClassChain::new([Class::of::<Linear>()])),
        ("m.embed", ClassChain::new([Class::of::<Embedding>()])),
        ("m.other", ClassChain::new([Class::named("Other")])),
    ]);
    let mut b = RegistryBuilder::<ExporterEntry>::empty();
    b.register(exporter(
        "proj_only",
        Tier::Normal,
        0,
        vec![Key::name("Embedding"), Key::name("Linear")],
        Some(is_proj),
    ));
    b.register(exporter(
        "either",
        Tier::Normal,
        0,
        vec![Key::of_class::<Embedding>(), Key::name("Linear")],
        None,
    ));
    let r = b.build().unwrap();
    let m = r.find(&tree.find("m.q_proj").unwrap()).unwrap();
    assert_eq!(
        (m.entry.meta.path.as_ref(), m.reason.key, m.reason.predicate),
        ("proj_only", Some(1), true)
    );
    assert_eq!(m.describe(), "key \"Linear\" + predicate pred");
    let m = r.find(&tree.find("m.embed").unwrap()).unwrap();
    assert_eq!(
        (m.entry.meta.path.as_ref(), m.reason.key),
        ("either", Some(0))
    );
    assert!(r.find(&tree.find("m.other").unwrap()).is_none());
}

#[test]
fn first_match_in_registry_order_wins_across_tiers() {
    let tree = tree_with(&[(
        "x",
        ClassChain::new([Class::of::<QuantLinear>(), Class::of::<Linear>()]),
    )]);
    let mut b = RegistryBuilder::<ExporterEntry>::empty();
    b.register(exporter(
        "catch_all",
        Tier::Fallback,
        100,
        vec![],
        Some(always),
    ));
    b.register(exporter(
        "generic",
        Tier::Normal,
        0,
        vec![Key::of_class::<Linear>()],
        None,
    ));
    b.register(exporter("refusing", Tier::Prepend, 0, vec![], Some(never)));
    let r = b.clone().build().unwrap();
    let x = tree.find("x").unwrap();
    assert_eq!(r.find(&x).unwrap().entry.meta.path, "generic");
    b.prepend(exporter(
        "mine",
        Tier::Normal,
        0,
        vec![Key::name("QuantLinear")],
        None,
    ));
    let r = b.build().unwrap();
    assert_eq!(r.find(&x).unwrap().entry.meta.path, "mine");
}

// Random registries and chains: the indexed matcher (shared cache and private cache) must
// agree with the linear scan of the rules, position and reason.
const NAMES: [&str; 4] = ["A", "B", "Linear", "Embedding"];
const PREDICATES: [PredicateFn; 3] = [always, never, is_proj];

fn arb_key() -> impl Strategy<Value = Key> {
    prop_oneof![
        (0..NAMES.len()).prop_map(|i| Key::name(NAMES[i])),
        Just(Key::of_class::<Linear>()),
        Just(Key::of_class::<Embedding>()),
        Just(Key::of_class::<QuantLinear>()),
    ]
}

fn arb_entry() -> impl Strategy<Value = (Vec<Key>, Option<usize>, u8, i8)> {
    (
        prop::collection::vec(arb_key(), 0..3),
        prop::option::of(0..PREDICATES.len()),
        0u8..3,
        -2i8..3,
    )
}

fn arb_class() -> impl Strategy<Value = Class> {
    prop_oneof![
        (0..NAMES.len()).prop_map(|i| Class::named(NAMES[i])),
        Just(Class::of::<Linear>()),
        Just(Class::of::<Embedding>()),
        Just(Class::of::<QuantLinear>()),
        Just(Class::named("Unrelated")),
    ]
}

proptest! {
    #[test]
    fn indexed_matching_agrees_with_the_linear_scan(
        entries in prop::collection::vec(arb_entry(), 0..24),
        chains in prop::collection::vec((prop::collection::vec(arb_class(), 0..4), any::<bool>()), 1..12),
    ) {
        let mut b = RegistryBuilder::<ExporterEntry>::empty();
        for (i, (keys, pred, tier, prio)) in entries.into_iter().enumerate() {
            let (keys, pred) = if keys.is_empty() && pred.is_none() { (keys, Some(0)) } else { (keys, pred) };
            let tier = [Tier::Prepend, Tier::Normal, Tier::Fallback][tier as usize];
            b.register(exporter(&format!("e{i}"), tier, prio as i32, keys, pred.map(|p| PREDICATES[p])));
        }
        let r = b.build().unwrap();
        let tree = {
            let mut t = ModuleTree::default();
            for (i, (classes, proj)) in chains.iter().enumerate() {
                let name = if *proj { format!("m{i}.x_proj") } else { format!("m{i}.x") };
                t.add(&name, ClassChain::new(classes.clone()), vec![]).unwrap();
            }
            t
        };
        let mut matcher = r.matcher();
        for _pass in 0..2 {
            for m in tree.walk() {
                let expect = r.find_linear(&m).map(|x| (x.position, x.reason));
                prop_assert_eq!(r.find(&m).map(|x| (x.position, x.reason)), expect);
                prop_assert_eq!(matcher.find(&m).map(|x| (x.position, x.reason)), expect);
            }
        }
    }
}

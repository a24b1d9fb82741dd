//! Registry benchmarks: building registries of 10 / 1,000 / 10,000 entries at run time, and
//! matching modules against 10 / 100 / 1,000 entries, beside a linear scan of the same rules.
//!
//! The workload follows the Python original's benchmark: a third of the entries are string
//! keys on the middle class of a 3-deep chain, a third type keys on the base class, a third
//! string keys on the leaf class with a predicate, and one catch-all predicate at the end.
//!
//! `cargo bench --bench registry`

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kiln::{
    Class, ClassChain, ExporterRegistry, ModuleClass, ModuleExporter, ModuleRef, ModuleTree,
};
use kiln_runtime::export::registry::{ExporterEntry, Key, Predicate};
use kiln_runtime::registry::{EntryMeta, RegistryBuilder, Tier};
use seq_macro::seq;
use std::borrow::Cow;
use std::hint::black_box;
use std::time::Duration;

struct Nop;
impl ModuleExporter for Nop {}

/// A family of distinct Rust types, so type keys do not collapse onto one `TypeId`.
struct Base<const N: usize>;
impl<const N: usize> ModuleClass for Base<N> {
    const NAME: &'static str = "Base";
}

const TYPED: usize = 340;

fn base(i: usize) -> (Key, Class) {
    seq!(N in 0..340 {
        match i % TYPED {
            #(N => (Key::of_class::<Base<N>>(), Class::of::<Base<N>>()),)*
            _ => unreachable!(),
        }
    })
}

fn is_proj(m: &ModuleRef<'_>) -> bool {
    m.local_name().ends_with("_proj")
}

fn any_module(_: &ModuleRef<'_>) -> bool {
    true
}

fn entry(i: usize) -> ExporterEntry {
    let (keys, predicate) = match i % 3 {
        0 => (vec![Key::Name(Cow::Owned(format!("Middle{i}")))], None),
        1 => (vec![base(i).0], None),
        _ => (
            vec![Key::Name(Cow::Owned(format!("Leaf{i}")))],
            Some(Predicate {
                func: is_proj,
                name: Cow::Borrowed("is_proj"),
            }),
        ),
    };
    ExporterEntry {
        meta: EntryMeta::new(format!("bench::Exporter{i:05}")),
        keys: Cow::Owned(keys),
        predicate,
        construct: || Box::new(Nop),
    }
}

/// `n - 1` keyed entries and the catch-all.
fn registry(n: usize) -> ExporterRegistry {
    let mut b = RegistryBuilder::with_capacity(n);
    for i in 0..n - 1 {
        b.register(entry(i));
    }
    let mut catch_all = ExporterEntry {
        meta: EntryMeta::new("bench::CatchAll"),
        keys: Cow::Borrowed(&[]),
        predicate: Some(Predicate {
            func: any_module,
            name: Cow::Borrowed("any_module"),
        }),
        construct: || Box::new(Nop),
    };
    catch_all.meta.tier = Tier::Fallback;
    b.register(catch_all);
    b.build().expect("generated registry is valid")
}

/// One module per keyed entry, with a 3-deep chain `Leaf{i} < Middle{i} < Base`; every other
/// module is a `_proj`, so half the predicate entries fall through to the catch-all.
fn modules(n: usize) -> ModuleTree {
    let mut tree = ModuleTree::default();
    for i in 0..n - 1 {
        let chain = ClassChain::new([
            Class::named(format!("Leaf{i}")),
            Class::named(format!("Middle{i}")),
            base(i).1,
        ]);
        let name = if i % 2 == 0 {
            format!("m{i}.x_proj")
        } else {
            format!("m{i}.x")
        };
        tree.add(&name, chain, vec![]).expect("unique names");
    }
    tree
}

fn bench_build(c: &mut Criterion) {
    let mut g = c.benchmark_group("registry_build");
    for n in [10usize, 1_000, 10_000] {
        let entries: Vec<ExporterEntry> = (0..n).map(entry).collect();
        g.throughput(Throughput::Elements(n as u64));
        g.bench_with_input(BenchmarkId::from_parameter(n), &entries, |b, entries| {
            b.iter_batched(
                || entries.clone(),
                |entries| {
                    let mut builder = RegistryBuilder::with_capacity(entries.len());
                    for e in entries {
                        builder.register(e);
                    }
                    builder.build().expect("valid")
                },
                BatchSize::LargeInput,
            )
        });
    }
    g.finish();
}

fn bench_match(c: &mut Criterion) {
    let mut g = c.benchmark_group("registry_match");
    for n in [10usize, 100, 1_000] {
        let registry = registry(n);
        let tree = modules(n);
        let leaves: Vec<ModuleRef<'_>> = tree
            .walk()
            .filter(|m| m.children().next().is_none())
            .collect();
        // Every leaf matches something: its own entry or the catch-all.
        assert!(leaves.iter().all(|m| registry.find_linear(m).is_some()));
        g.throughput(Throughput::Elements(leaves.len() as u64));
        g.bench_function(BenchmarkId::new("matcher", n), |b| {
            let mut matcher = registry.matcher();
            b.iter(|| {
                for m in &leaves {
                    black_box(matcher.find(m).map(|x| x.position));
                }
            })
        });
        g.bench_function(BenchmarkId::new("shared_cache", n), |b| {
            b.iter(|| {
                for m in &leaves {
                    black_box(registry.find(m).map(|x| x.position));
                }
            })
        });
        g.bench_function(BenchmarkId::new("linear_scan", n), |b| {
            b.iter(|| {
                for m in &leaves {
                    black_box(registry.find_linear(m).map(|x| x.position));
                }
            })
        });
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
}

criterion_group! { name = benches; config = config(); targets = bench_build, bench_match }
criterion_main!(benches);

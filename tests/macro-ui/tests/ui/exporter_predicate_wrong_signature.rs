use kiln::{exporter, ModuleExporter, ModuleRef};

fn takes_a_string(name: &str) -> bool {
    name.is_empty()
}

#[exporter(predicate = takes_a_string)]
struct WrongPredicate;
impl ModuleExporter for WrongPredicate {}

fn _uses(_: ModuleRef<'_>) {}

fn main() {}

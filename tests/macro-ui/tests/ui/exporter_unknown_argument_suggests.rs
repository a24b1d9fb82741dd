use kiln::{exporter, ModuleExporter};

#[exporter(keys = ["Linear"], prio = 1)]
struct Typo;
impl ModuleExporter for Typo {}

fn main() {}

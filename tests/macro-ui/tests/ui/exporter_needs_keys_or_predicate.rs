use kiln::{exporter, ModuleExporter};

#[exporter(priority = 1)]
struct Nothing;
impl ModuleExporter for Nothing {}

fn main() {}

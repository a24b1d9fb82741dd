use kiln::{exporter, ModuleExporter};

#[exporter(keys = [String])]
struct NotAClass;
impl ModuleExporter for NotAClass {}

fn main() {}

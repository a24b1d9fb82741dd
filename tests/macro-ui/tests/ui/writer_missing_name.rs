use kiln::writer;

#[writer(priority = 1)]
struct NoName;

fn main() {}
